"""``make mutants FULL=1``: mechanical mutants of every function of the code under test, each judged by the
tests that ran that function; report in reports/mutants-full-<time>/.

cosmic-ray is the tool because it generates mutations with pure, pluggable operators
(``mutate_code``) and keeps a resumable sqlite session, so each mutant is written into the
scratch overlay (never into the venv or the checkout) and judged by our own test selection;
mutmut 3 instead rewrites the project's own sources into trampolines under ``mutants/`` and
drives the test run itself, which reaches neither vLLM in site-packages nor reader processes.

A mutant's tests are the green tests that ran its changed statement in one coverage run
(``coverage_map``), the tests that killed its function's earlier mutants first, then fastest first,
``-x``; a mutant on a line no test ran is uncovered without a run; a mutant outside every function (module and class level) is skipped, as is a function the
target does not name. Each module has its own session under ``.cache/mutants/`` (keyed by its
source and the operators), stored after every mutant: a run resumes where the last one stopped.
Survivors are open unless ``EQUIVALENT`` argues them equivalent.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_zerocopy_testbed.config import REPO_ROOT
from vllm_zerocopy_testbed.mutants import coverage_map, overlay, run
from vllm_zerocopy_testbed.mutants.catalog import ARENA, BROADCAST, DETACH, INFLIGHT, RAY_EXECUTOR, RAY_UTILS, SHM

SHM_ARENA = "vllm.distributed.device_communicators.shm_tensor_arena"
DETACH_CALL = "detach_zero_copy_from_model_runner_output"
CACHE = REPO_ROOT / ".cache" / "mutants"

# The tests the full set's coverage map is built from: what `make test-core` runs.
FULL_COVERAGE = coverage_map.CoverageRequest(("tests",), "unit or component", "")

KILLED, SURVIVED, UNCOVERED, EQUIV, ERROR, SKIPPED = "killed", "survived", "uncovered", "equivalent", "error", "skipped"


@dataclass(frozen=True)
class Target:
    """A module under mutation; ``calling``: only the functions that name it (and their nested ones)."""

    module: str
    calling: str = ""

    @property
    def file_name(self) -> str:
        return self.module.replace(".", "__") + ".py"

    def selects(self, source: str, qualname: str) -> bool:
        """Whether ``qualname`` of ``source`` is under mutation."""
        if not self.calling:
            return True
        return any(qualname == c or qualname.startswith(c + ".") for c in _naming(source, self.calling))


@functools.lru_cache(maxsize=16)
def _naming(source: str, name: str) -> tuple[str, ...]:
    """Return the functions of ``source`` that are ``name`` or mention it in their body."""
    lines = source.splitlines()
    return tuple(f.qualname for f in coverage_map.functions(source)
                 if f.qualname.rsplit(".", 1)[-1] == name
                 or re.search(rf"\b{re.escape(name)}\b", "\n".join(lines[f.start - 1:f.end])))


TARGETS: tuple[Target, ...] = (
    Target(SHM),
    Target(SHM_ARENA),
    Target(RAY_UTILS, calling=DETACH_CALL),
    Target(RAY_EXECUTOR, calling=DETACH_CALL),
    Target(BROADCAST),
    Target(DETACH),
    Target(INFLIGHT),
    Target(ARENA),
)

# Mutants argued equivalent: "module-tail::function::old line -> new line" (stripped, the lines of a
# multi-line change joined by " / ") -> why. Keyed by text, not by position, so a key survives
# unrelated edits of the file; ``*`` stands for any text (nothing else is special).
_SPINLOOP_OFF = ("unreachable here: the spinloop branch runs only with VLLM_USE_SPINLOOP_EXT=1 (vllm.envs: "
                 "off by default), which no test, compose profile or vLLM default sets; the line never runs "
                 "in the testbed (a gap to close if the testbed ever enables the extension)")
_AT_THE_INSTANT = ("differs only when the float seconds of time.monotonic() equal the bound exactly: the wait "
                   "loop checks again microseconds later, past it either way (the same warning or TimeoutError)")
_MS_EARLY = ("a read's time is kept to whole milliseconds (int() drops the fraction: vLLM itself gives up up to 1 ms "
             "early); this gives up a millisecond sooner or later, or 0.1% of the timeout (2.5 ms in 2.5 s, under a "
             "poll's own jitter); a ring reader's wait is rechecked against the same deadline: the same TimeoutError")
_ANY_FREE_SLOT = ("the order of the probes, and where the next write starts them, only decide which free slot a "
                  "tensor takes: every probe checks that slot's own flags before claiming it, and the message names "
                  "the slot it took")
_ARENA_CLAIM = ("the claim (written flag 0 while the bytes are copied) matters only if the copy raised between it "
                "and the publish, which sets the reader flags to 0 and the written flag to 1 whatever the claim left: "
                "one writer thread, readers never read the written flag, and a copy of nbytes uint8 into a view of "
                "nbytes (both checked against the slot before) cannot raise")
EQUIVALENT: dict[str, str] = {
    "shm_broadcast::MessageQueue.acquire_*::spinloop(* -> *": _SPINLOOP_OFF,
    "shm_broadcast::MessageQueue.acquire_read::metadata_buffer[0 : self.local_reader_rank + 1], -> *": _SPINLOOP_OFF,
    "shm_broadcast::MessageQueue.acquire_read::timeout=SPINLOOP_TIMEOUT_SECONDS, -> *": _SPINLOOP_OFF,
    "shm_broadcast::MessageQueue.acquire_write::if timeout is not None and elapsed > timeout: -> "
    "if timeout is not None and elapsed >= timeout:": _AT_THE_INSTANT,
    "shm_broadcast::MessageQueue.acquire_write::if elapsed > VLLM_RINGBUFFER_WARNING_INTERVAL * n_warning: -> "
    "if elapsed >= VLLM_RINGBUFFER_WARNING_INTERVAL * n_warning:": _AT_THE_INSTANT,
    "shm_broadcast::MessageQueue.ReadTimeoutWithWarnings.should_warn::if elapsed >= VLLM_RINGBUFFER_WARNING_INTERVAL "
    "* self.n_warning: -> if elapsed > VLLM_RINGBUFFER_WARNING_INTERVAL * self.n_warning:": _AT_THE_INSTANT,
    "shm_broadcast::SpinCondition.wait::if current_time <= self.last_read + self.busy_loop_s: -> "
    "if current_time < self.last_read + self.busy_loop_s:": _AT_THE_INSTANT,
    "shm_broadcast::MessageQueue.ReadTimeoutWithWarnings.__init__::VLLM_RINGBUFFER_WARNING_INTERVAL * 1000 if "
    "should_warn else None -> VLLM_RINGBUFFER_WARNING_INTERVAL * 999 if should_warn else None": (
        "the idle reader wakes 1 ms per second before each interval's mark instead of at it: should_warn logs "
        "line n at the first wake at or after n intervals, so each line comes one wake later, and the wait's "
        "last wake (its message or its deadline) logs any line still due: the same lines over every wait"),
    "shm_broadcast::MessageQueue.recv::timeout_ms = None if timeout is None else max(0, int(timeout * 1000)) -> "
    "timeout_ms = None if timeout is None else max( 1, int(timeout * 1000))": (
        "a socket read with no time left polls 1 ms instead of 0: the same TimeoutError a millisecond later, or "
        "a message that came within that millisecond, as if it had come a millisecond sooner"),
    "shm_broadcast::MessageQueue.recv::timeout_ms = None if timeout is None else max(0, int(timeout * 1000)) -> "
    "timeout_ms = None if timeout is None else max(0, int(timeout * 999))": _MS_EARLY,
    "shm_broadcast::MessageQueue.recv::timeout_ms = None if timeout is None else max(0, int(timeout * 1000)) -> "
    "timeout_ms = None if timeout is None else max(0, int(timeout * 1001))": _MS_EARLY,
    "shm_broadcast::MessageQueue.dequeue::buf_count = from_bytes_big(buf[1:offset]) -> "
    "buf_count = from_bytes_big(buf[ 0:offset])": (
        "byte 0 is the overflow flag, 0 on this branch (`if not overflow`): the count read from bytes 0-2 is the "
        "same number with a leading zero byte"),
    "shm_broadcast::MessageQueue.ReadTimeoutWithWarnings.should_warn::return False -> return None": (
        "its one caller (`acquire_read`) tests it for truth only, and None is as false as False"),
    "shm_broadcast::SpinCondition.*::logger.debug(* -> pass": (
        "a DEBUG line (vLLM logs at INFO unless VLLM_LOGGING_LEVEL says otherwise); nothing waits on it"),
    "shm_broadcast::SpinCondition.wait::self.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False) -> "
    "self.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=True)": (
        "the one-byte notification is read only to be dropped: a copy of it or a frame of it, nothing uses either"),
    "shm_broadcast::MessageQueue.ReadTimeoutWithWarnings.timeout_ms::if time_left_ms <= 0: -> if time_left_ms < 0:": (
        "with 0 ms left the reader waits 0 ms once more and the next check raises: the same TimeoutError, "
        "microseconds later"),
    "shm_broadcast::MessageQueue.ReadTimeoutWithWarnings.timeout_ms::time_left_ms = int((self.deadline - "
    "time.monotonic()) * 1000) -> time_left_ms = int((self.deadline - time.monotonic()) * 999)": _MS_EARLY,
    "shm_broadcast::MessageQueue.ReadTimeoutWithWarnings.timeout_ms::time_left_ms = int((self.deadline - "
    "time.monotonic()) * 1000) -> time_left_ms = int((self.deadline - time.monotonic()) * 1001)": _MS_EARLY,
    "shm_broadcast::MessageQueue.ReadTimeoutWithWarnings.timeout_ms::if time_left_ms <= 0: -> "
    "if time_left_ms <= 1:": _MS_EARLY,
    "shm_broadcast::MessageQueue.ReadTimeoutWithWarnings.timeout_ms::if time_left_ms <= 0: -> "
    "if time_left_ms <= -1:": _MS_EARLY,
    "shm_broadcast::MessageQueue.acquire_write::for i in range(1, self.buffer.n_reader + 1): -> "
    "for i in range( 0, self.buffer.n_reader + 1):": (
        "index 0 is the written flag, set to 0 before the caller wrote the chunk and to 1 after this loop: clearing "
        "it once more in between writes the value it already holds (one writer; readers only read it)"),
    "shm_broadcast::MessageQueue.acquire_write::metadata_buffer[0] = 1 -> metadata_buffer[0] = 2": (
        "the written flag is only tested for truth (both checks: `written_flag and ...`, `not written_flag`), and "
        "2 is as true as 1; the spinloop extension that reads the flags natively is off (VLLM_USE_SPINLOOP_EXT)"),
    "shm_tensor_arena::ShmTensorArena.write_tensor::idx = (self._next_slot + probe) % self.n_slots -> "
    "idx = (self._next_slot - probe) % self.n_slots": _ANY_FREE_SLOT,
    "shm_tensor_arena::ShmTensorArena.write_tensor::meta[0] = 0  # claim -> *": _ARENA_CLAIM,
    "shm_tensor_arena::ShmTensorArena.write_tensor::self._next_slot = (idx + 1) % self.n_slots -> *": _ANY_FREE_SLOT,
    "shm_tensor_arena::ShmTensorArena.write_tensor::meta[0] = 1 -> meta[0] = 2": (
        "the written flag is only compared with 0 (`meta[0] == 0` in the writer's check; readers never read it): "
        "2 is as written as 1"),
    "shm_tensor_arena::ShmTensorArena.write_tensor::for i in range(1, self.n_reader + 1): -> "
    "for i in range( 0, self.n_reader + 1):": (
        "index 0 is the written flag, claimed as 0 before the copy and set to 1 right after this loop: clearing it "
        "once more in between writes the value it already holds (one writer; readers never read it)"),
    "shm_tensor_arena::ShmTensorArena.write_tensor::slot_mv.release() -> pass": (
        "CPython frees the slot's memoryview (and the tensor over it) when write_tensor returns, a few statements "
        "later; nothing closes the mapping in between, so no BufferError and no other effect"),
    "shm_broadcast::MessageQueue.enqueue.oob_callback::return False -> return None": (
        "pickle keeps a buffer out of band when buffer_callback returns any false value (the pickle module's "
        "documentation of Pickler's buffer_callback: 'a false value (such as None)'): the same stream"),
}


# Survivors no unit or component test on this machine can tell apart, and why: they stay open (a score counts
# them as survivors), but the report gives the reason beside them instead of "unexplained". Same keys as above.
_X86_ORDER = ("the fence orders stores for weakly ordered CPUs; x86-64 never reorders a store with an earlier store "
              "or a load with an earlier load, so nothing here can see it gone: an aarch64 host (or a GPU runner on "
              "one) would")
_CUDA_EVENT = ("the release waits on the CUDA event of a pinned host-to-device copy: the branch runs only on a CUDA "
               "host, and no GPU was lent (the GPU profile: `scripts/gpu-smoke.sh`)")
_CUDA_PIN = ("the arena's pages are registered with CUDA (cudaHostRegister) on a CUDA host only; elsewhere the call "
             "returns at once, so without it the same tensors arrive; on a GPU host each host-to-device copy of an arena "
             "tensor would be pageable, slower only, which no test here could see either")
OUT_OF_REACH: dict[str, str] = {
    "*::memory_fence() -> pass": _X86_ORDER,
    "ray_executor::RayDistributedExecutor._execute_dag::self.forward_dag = self._compiled_ray_dag(enable_asyncio=False)"
    " -> self.forward_dag = self._compiled_ray_dag(enable_asyncio=True)": (
        "the executor builds its graph at its first step from the Ray workers its __init__ started (vLLM's "
        "model workers); the component tests give it a graph built from their own actors, so the build never "
        "runs here: only an engine served over Ray (e2e) builds it"),
    "shm_tensor_arena::ShmTensorArena.get_tensor::self._ensure_pinned() -> pass": _CUDA_PIN,
    # The pin and its undoing: past the once-only flag, every statement is inside `try: ... except Exception` (or
    # `suppress(Exception)`) behind `is_cuda_alike()`, so a mutant here changes at most an INFO line off CUDA.
    "shm_tensor_arena::ShmTensorArena._ensure_pinned::*": _CUDA_PIN,
    "shm_tensor_arena::ShmTensorArena._unpin::*": _CUDA_PIN,
    "shm_broadcast::SpinCondition.wait::sched_yield() -> pass": (
        "speed only, and only on an oversubscribed host: a reader in its busy loop holds its core either way; "
        "sched_yield gives it away only when another thread waits for that core"),
    "shm_broadcast::MessageQueue.acquire_write::sched_yield() -> pass": (
        "speed only, and only on an oversubscribed host: a writer waiting at a full ring holds its core either way; "
        "sched_yield gives it away only when another thread waits for that core"),
    "shm_broadcast::MessageQueue.acquire_read::self._spin_condition.record_read() -> pass": (
        "speed only: without the time of its last read a reader never busy-loops after a read, and each wait sleeps "
        "on the writer's notification: the same messages, each a wake-up later (`make check`'s speed step measures "
        "that; a CPU or latency bound inside a test would not survive a busy machine)"),
    "shm_broadcast::MessageQueue.dequeue::all_buffers.append(buffer if i == 0 else bytearray(buffer)) -> "
    "all_buffers.append(buffer if i == -1 else bytearray(buffer))": (
        "speed only: the pickle stream is copied out of the ring like the out-of-band buffers, and pickle.loads "
        "builds the same objects from a copy (none of them aliases the stream); the cost is one copy of the "
        "stream, a few KiB for a scheduler output, which only `make check`'s speed step could see"),
    "shm_tensor_arena::ShmTensorArena.flush_releases::if self._deferred_releases: -> *": _CUDA_EVENT,
    "shm_tensor_arena::ShmTensorArena.flush_releases::if deferred_event.query(): -> *": _CUDA_EVENT,
    "shm_tensor_arena::ShmTensorArena.flush_releases::self._mark_released(idxs) -> pass": _CUDA_EVENT,
    "shm_tensor_arena::ShmTensorArena.flush_releases::still_pending.append((deferred_event, idxs)) -> pass":
        _CUDA_EVENT,
    "shm_tensor_arena::ShmTensorArena.flush_releases::self._deferred_releases.append((event, idxs)) -> pass":
        _CUDA_EVENT,
    "shm_tensor_arena::ShmTensorArena._record_release_event::*": _CUDA_EVENT,
}


def equivalent_reason(key: str, table: dict[str, str] | None = None) -> str:
    """Return why the mutant ``key`` is argued equivalent, or "" (the first pattern of ``table`` that matches)."""
    for pattern, reason in (EQUIVALENT if table is None else table).items():
        if re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), key, flags=re.DOTALL):
            return reason
    return ""

# --- operators: cosmic-ray's, restricted to those meaningful here, plus two of ours -----------

# Comparison: negation and boundary only (cosmic-ray makes every permutation).
_COMPARISONS = {("Eq", "NotEq"), ("NotEq", "Eq"), ("Lt", "LtE"), ("LtE", "Lt"), ("Gt", "GtE"), ("GtE", "Gt"),
                ("Lt", "GtE"), ("GtE", "Lt"), ("Gt", "LtE"), ("LtE", "Gt"), ("Is", "IsNot"), ("IsNot", "Is")}
# Arithmetic: each operator to its inverse (sizes, offsets, shifts, flags).
_ARITHMETIC = {("Add", "Sub"), ("Sub", "Add"), ("Mul", "FloorDiv"), ("FloorDiv", "Mul"), ("Div", "Mul"),
               ("Mod", "FloorDiv"), ("LShift", "RShift"), ("RShift", "LShift"), ("BitAnd", "BitOr"),
               ("BitOr", "BitAnd")}
_PLAIN = {"AddNot", "ReplaceTrueWithFalse", "ReplaceFalseWithTrue", "ReplaceAndWithOr", "ReplaceOrWithAnd",
          "ReplaceBreakWithContinue", "ReplaceContinueWithBreak", "NumberReplacer"}


def chosen_core_operator(name: str) -> bool:
    """Whether cosmic-ray's core operator ``name`` (without ``core/``) is in the mechanical set."""
    if name in _PLAIN:
        return True
    for prefix, pairs in (("ReplaceComparisonOperator_", _COMPARISONS), ("ReplaceBinaryOperator_", _ARITHMETIC)):
        if name.startswith(prefix):
            return tuple(name[len(prefix):].split("_")) in pairs
    return False


def _custom_operators() -> dict[str, type]:
    """Return the return-value and remove-call operators (cosmic-ray has neither)."""
    import parso.python.tree as tree
    from cosmic_ray.operators.operator import Example, Operator

    class ReturnNone(Operator):
        """``return <value>`` -> ``return None``: a result computed and dropped."""

        def mutation_positions(self, node):
            if node.type == "return_stmt" and len(node.children) == 2 and node.children[1].get_code().strip() != "None":
                yield node.start_pos, node.end_pos

        def mutate(self, node, index):
            node.children[1] = tree.Keyword("None", node.children[1].start_pos, prefix=" ")
            return node

        @classmethod
        def examples(cls):
            return (Example("def f():\n    return x + 1\n", "def f():\n    return None\n"),)

    class RemoveCall(Operator):
        """A statement that is only a call (``f(x)``, ``a.b.c()``) -> ``pass``: a side effect lost."""

        def mutation_positions(self, node):
            if (node.type in ("atom_expr", "power") and node.parent is not None and node.parent.type == "simple_stmt"
                    and node.children[0].type != "keyword" and node.children[-1].type == "trailer"
                    and node.children[-1].children[0].value == "("):
                yield node.start_pos, node.end_pos

        def mutate(self, node, index):
            return tree.Keyword("pass", node.start_pos, prefix=node.get_first_leaf().prefix)

        @classmethod
        def examples(cls):
            return (Example("def f():\n    g(1)\n", "def f():\n    pass\n"),)

    return {"ReturnNone": ReturnNone, "RemoveCall": RemoveCall}


class _Provider:
    """cosmic-ray operator provider of the mechanical set (provider name ``testbed``)."""

    def __init__(self) -> None:
        from cosmic_ray.operators.provider import OperatorProvider

        core = OperatorProvider()
        self._ops: dict[str, type] = {name: core[name] for name in core if chosen_core_operator(name)}
        self._ops.update(_custom_operators())

    def __iter__(self) -> Iterator[str]:
        return iter(self._ops)

    def __getitem__(self, name: str) -> type:
        return self._ops[name]


PROVIDER = "testbed"


def _install_provider() -> None:
    import cosmic_ray.plugins

    cosmic_ray.plugins.OPERATOR_PROVIDERS.setdefault(PROVIDER, _Provider())


@contextlib.contextmanager
def _only_our_operators() -> Iterator[None]:
    """cosmic-ray's ``init`` uses every provider's operators: show it ours alone."""
    import cosmic_ray.plugins

    _install_provider()
    saved = dict(cosmic_ray.plugins.OPERATOR_PROVIDERS)
    cosmic_ray.plugins.OPERATOR_PROVIDERS.clear()
    cosmic_ray.plugins.OPERATOR_PROVIDERS[PROVIDER] = saved[PROVIDER]
    try:
        yield
    finally:
        cosmic_ray.plugins.OPERATOR_PROVIDERS.clear()
        cosmic_ray.plugins.OPERATOR_PROVIDERS.update(saved)


def operator_names() -> list[str]:
    """Return the mechanical set's operator names (``testbed/...``)."""
    _install_provider()
    import cosmic_ray.plugins

    return sorted(f"{PROVIDER}/{name}" for name in cosmic_ray.plugins.OPERATOR_PROVIDERS[PROVIDER])


# --- the session: cosmic-ray's work database over pristine copies -----------------------------

@dataclass(frozen=True)
class Planned:
    """One mutant of the session: where it is and what it is."""

    job_id: str
    module: str
    function: str
    operator: str
    occurrence: int
    line: int
    skipped: str = ""  # why it does not run


@dataclass
class Session:
    """A cosmic-ray session folder: ``session.sqlite`` and the pristine copies it mutates."""

    folder: Path
    sources: dict[str, str]  # module -> pristine text

    @property
    def db_path(self) -> Path:
        return self.folder / "session.sqlite"

    def open(self):
        from cosmic_ray.work_db import WorkDB

        return WorkDB(str(self.db_path), WorkDB.Mode.open)

    def module_of(self, path: Path) -> str:
        return next(t.module for t in TARGETS if t.file_name == Path(path).name)


def target_sources(targets: tuple[Target, ...] = TARGETS) -> dict[str, Path]:
    """Return the installed file of every target module (module -> path)."""
    return {t.module: overlay.module_source(t.module) for t in targets}


def open_session(files: dict[str, Path], cache: Path = CACHE) -> tuple[Session, bool]:
    """Return the session for these sources and operators, creating it if there is none (and whether it was).

    ``run_full`` keeps one session per module, so a changed file starts its own mutants afresh only.
    """
    from cosmic_ray.commands.init import init
    from cosmic_ray.work_db import WorkDB

    sources = {m: p.read_text() for m, p in files.items()}
    key = coverage_map.digest([*operator_names(), *(f"{m}\0{t}" for m, t in sorted(sources.items()))])
    session = Session(cache / f"mechanical-{key}", sources)
    if session.db_path.exists():
        return session, False
    src = session.folder / "src"
    src.mkdir(parents=True, exist_ok=True)
    targets = {t.module: t for t in TARGETS}
    paths = []
    for module, text in sources.items():
        path = src / targets[module].file_name
        path.write_text(text)
        paths.append(path)
    partial = session.folder / "session.sqlite.partial"
    partial.unlink(missing_ok=True)
    db = WorkDB(str(partial), WorkDB.Mode.create)
    try:
        with _only_our_operators():
            init(paths, db, {})
        _skip_out_of_scope(session, db, targets)
    finally:
        db.close()
    partial.rename(session.db_path)  # only a complete session is resumed
    return session, True


def plan(session: Session, db) -> list[Planned]:
    """Return every mutant of the session in file and line order, with its function."""
    targets = {t.module: t for t in TARGETS}
    funcs = {m: coverage_map.functions(text) for m, text in session.sources.items()}
    planned = []
    for item in db.work_items:
        spec = item.mutations[0]
        module = session.module_of(spec.module_path)
        line = spec.start_pos[0]
        function = coverage_map.function_at(funcs[module], line)
        skipped = ""
        if function == coverage_map.MODULE_LEVEL:
            skipped = "module or class level (the hand-written catalog's job)"
        elif not targets[module].selects(session.sources[module], function):
            skipped = f"not a function that calls {targets[module].calling}"
        planned.append(Planned(item.job_id, module, function, spec.operator_name, spec.occurrence, line, skipped))
    order = {t.module: i for i, t in enumerate(TARGETS)}
    return sorted(planned, key=lambda p: (order[p.module], p.line, p.operator, p.occurrence))


def _skip_out_of_scope(session: Session, db, targets: dict[str, Target]) -> None:
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    for p in plan(session, db):
        if p.skipped:
            db.set_result(p.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED,
                                               output=json.dumps({"fate": SKIPPED, "message": p.skipped})))


# --- judging one mutant ---------------------------------------------------------------------

@dataclass
class Verdict:
    """What became of one mechanical mutant."""

    job_id: str
    module: str
    function: str
    operator: str
    line: int
    change: str  # "old line -> new line", stripped
    fate: str
    killed_by: str = ""
    message: str = ""
    tests: int = 0
    seconds: float = 0.0
    loads: int = 0
    equivalent: str = ""
    killer: str = ""  # the killing test's node id, as the coverage map names it
    map_key: str = ""  # the coverage map (tests and testbed) it was judged under
    lines: list[int] = field(default_factory=list)  # the lines the mutant changed
    judges: str = ""  # what its tests rest on (``CoverageMap.judges_key``): unchanged, a survivor stands

    @property
    def key(self) -> str:
        return f"{self.module.rsplit('.', 1)[-1]}::{self.function}::{self.change}"


def describe_change(pristine: str, mutated: str) -> tuple[int, str]:
    """Return the first changed line of ``pristine`` and the change as ``old -> new`` (stripped)."""
    old, new = pristine.splitlines(), mutated.splitlines()
    matcher = difflib.SequenceMatcher(a=old, b=new, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            before = " / ".join(s.strip() for s in old[i1:i2])
            after = " / ".join(s.strip() for s in new[j1:j2])
            return i1 + 1, f"{before} -> {after}"
    return 0, ""


def judge_one(planned: Planned, session: Session, cmap: coverage_map.CoverageMap, scratch: Path,
              run_tests: Callable[..., run.Outcome] = run.run_tests, first: tuple[str, ...] = ()) -> Verdict:
    """Apply one mutant through a scratch overlay and run the tests that ran its changed lines (``first``,
    the tests that killed its function's mutants before, lead)."""
    import cosmic_ray.plugins
    from cosmic_ray.mutating import mutate_code

    _install_provider()
    pristine = session.sources[planned.module]
    verdict = Verdict(planned.job_id, planned.module, planned.function, planned.operator, planned.line, "", ERROR,
                      map_key=cmap.key)
    operator = cosmic_ray.plugins.get_operator(planned.operator)()
    mutated = mutate_code(pristine, operator, planned.occurrence)
    if mutated is None:
        verdict.message = "cosmic-ray applied no mutation at this occurrence"
        return verdict
    verdict.line, verdict.change = describe_change(pristine, mutated)
    try:
        verdict.function = coverage_map.changed_function(pristine, mutated)
    except ValueError as exc:
        verdict.message = str(exc)
        return verdict
    changed = coverage_map.changed_lines(pristine, mutated)
    tests = cmap.tests_for_lines(planned.module, pristine, changed, verdict.function, first)
    verdict.tests, verdict.lines, verdict.judges = len(tests), changed, cmap.judges_key(tests)
    verdict.equivalent = equivalent_reason(verdict.key)
    if not cmap.tests_for(planned.module, verdict.function):
        verdict.fate = UNCOVERED
        verdict.message = "no green test of the coverage run ran this function"
        return verdict
    # A changed line no test ran cannot be seen by the tests: a survivor without a run.
    if not tests or not any(cmap.ran_line(planned.module, pristine, line) for line in changed):
        verdict.fate = UNCOVERED
        verdict.message = "no green test of the coverage run ran the changed line"
        return verdict
    try:
        overlay.build_sources(scratch, {planned.module: mutated})
    except overlay.OverlayError as exc:
        verdict.message = str(exc)
        return verdict
    outcome = run_tests(tuple(tests), "", scratch, pythonpath=scratch)
    verdict.seconds = round(outcome.seconds, 1)
    verdict.loads = overlay.loads(scratch).get(planned.module, 0)
    if outcome.returncode == 0 and verdict.loads == 0:
        verdict.message = f"no process imported {planned.module} from the overlay: the tests never ran the change"
    elif outcome.returncode == 0:
        verdict.fate = SURVIVED  # equivalent or open: decided when reported (EQUIVALENT may change)
    elif outcome.returncode in (1, -9):
        verdict.fate, verdict.killed_by, verdict.message = KILLED, outcome.failed_test or "timeout", outcome.message
        verdict.killer = node_id(verdict.killed_by, tests)
    else:
        verdict.message = f"pytest exited {outcome.returncode}: {outcome.message}"
    return verdict


def node_id(junit_name: str, tests: list[str]) -> str:
    """Return the node id among ``tests`` that ``run``'s JUnit name (``<module or class>::<name>``) names, or ""."""
    owner, _, name = junit_name.partition("::")
    for test in tests:
        path, _, rest = test.partition("::")
        if (rest == name and Path(path).stem == owner) or rest == junit_name:
            return test
    return ""


def _result(verdict: Verdict):
    """cosmic-ray's record of a verdict (``cr-report`` reads it too); ours is the JSON in ``output``."""
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    test_outcome = {KILLED: TestOutcome.KILLED, SURVIVED: TestOutcome.SURVIVED, EQUIV: TestOutcome.SURVIVED,
                    UNCOVERED: TestOutcome.SURVIVED}.get(verdict.fate, TestOutcome.INCOMPETENT)
    return WorkResult(worker_outcome=WorkerOutcome.NORMAL, test_outcome=test_outcome,
                      output=json.dumps(asdict(verdict)), diff=verdict.change)


# --- the run ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Selection:
    """Which pending mutants a run takes: a module tail, a function, at most ``limit``."""

    module: str = ""
    function: str = ""
    limit: int = 0

    def takes(self, p: Planned) -> bool:
        if self.module and not (p.module == self.module or p.module.endswith("." + self.module)):
            return False
        return not self.function or p.function == self.function or p.function.endswith("." + self.function)


def estimate(todo: list[Planned], cmap: coverage_map.CoverageMap, sources: dict[str, str]) -> float:
    """Return the seconds ``todo`` takes at most (every test of every mutant runs: all survive)."""
    total = 0.0
    for p in todo:
        tests = cmap.tests_for_lines(p.module, sources[p.module], [p.line], p.function)
        if tests and cmap.ran_line(p.module, sources[p.module], p.line):  # an uncovered mutant runs nothing
            total += cmap.seconds_for(tests)
    return total


def stale(db, current: str) -> set[str]:
    """The mutants to judge again: those that survived or were uncovered under another coverage map (the
    tests or the testbed changed since: a test added for a survivor may kill it now). Killed stays killed."""
    found = set()
    for job, result in db.results:
        data = json.loads(result.output or "{}")
        if data.get("fate") in (SURVIVED, UNCOVERED) and data.get("map_key", "") != current:
            found.add(job)
    return found


def same_judges(db, cmap: coverage_map.CoverageMap, sources: dict[str, str]) -> set[str]:
    """The stale survivors (``stale``) whose verdict stands: under ``cmap`` the same tests, from the same test
    files, over the same testbed and vLLM sources, ran the lines they change. A new or changed test that
    reaches such a line, or any change outside the test files, judges them again; each costs a full run of
    its tests (~3 min for a ring function's), which a test written for another function cannot change."""
    found, results = set(), dict(db.results)
    for job in stale(db, cmap.key):
        data = json.loads(results[job].output or "{}")
        module, lines = data.get("module", ""), data.get("lines")
        if not data.get("judges") or not lines or module not in sources:
            continue
        tests = cmap.tests_for_lines(module, sources[module], lines, data.get("function", ""))
        if cmap.judges_key(tests) == data["judges"]:
            found.add(job)
    return found


def verdicts(db) -> list[Verdict]:
    """Return every judged (not skipped) mutant of a session from its results."""
    found = []
    for _, result in db.results:
        data = json.loads(result.output or "{}")
        if data.get("fate") and data["fate"] != SKIPPED and "job_id" in data:
            v = Verdict(**data)
            v.equivalent = equivalent_reason(v.key)
            if v.fate in (SURVIVED, UNCOVERED) and v.equivalent:
                v.fate = EQUIV
            found.append(v)
    return found


def run_full(selection: Selection, out: Path, request: coverage_map.CoverageRequest = FULL_COVERAGE,
             say: Callable[[str], None] = print, list_only: bool = False, report_only: bool = False,
             cache: Path = CACHE) -> dict[str, int]:
    """Generate (or resume) a session per module, build (or reuse) the coverage map, run the selected pending mutants.

    ``list_only``: say what would run; ``report_only``: write the report of what the sessions judged so far.
    """
    files = target_sources()
    sessions = [open_session({module: path}, cache) for module, path in files.items()]
    dbs = [session.open() for session, _ in sessions]
    try:
        planned: list[tuple[Planned, Session, object]] = []
        done: set[str] = set()
        say(f"{len(operator_names())} operators; a session per module under {cache}:")
        current = coverage_map.map_key({m: p.read_text() for m, p in files.items()}, request)
        for (session, created), db in zip(sessions, dbs):
            mine = plan(session, db)
            judged = {job for job, _ in db.results} - stale(db, current)
            done |= judged
            planned += [(p, session, db) for p in mine]
            live = [p for p in mine if not p.skipped]
            say(f"  {next(iter(session.sources))}: {len(live)} mutants ({len(mine) - len(live)} skipped: module "
                f"level, or no detach call site), {sum(p.job_id not in judged for p in live)} not judged yet "
                f"({'new' if created else 'resumed'} {session.folder.name})")
        if report_only:
            return _report(dbs, out, [s for s, _ in sessions], None)
        pending = [t for t in planned if t[0].job_id not in done and selection.takes(t[0])]
        if selection.limit:
            pending = pending[:selection.limit]
        if list_only:
            for p, _, _ in pending:
                say(f"  {p.module.rsplit('.', 1)[-1]}:{p.line} {p.function} {p.operator}#{p.occurrence}")
            return {}
        say(f"coverage map: {' '.join(request.pytest_args())}")
        cmap, built = coverage_map.load_or_build(files, request, cache, say)
        say(f"coverage map {'built' if built else 'cached'}: {len(cmap.tests)} tests, red (no judges): "
            f"{cmap.red() or 'none'}; pytest start {cmap.session_seconds:.0f} s")
        sources = {m: p.read_text() for m, p in files.items()}
        standing = set().union(*(same_judges(db, cmap, sources) for db in dbs))
        if standing:
            say(f"{len(standing)} survivors stand: the tests that ran their lines are unchanged")
        done |= standing
        pending = [t for t in pending if t[0].job_id not in standing]
        whole = [p for p, _, _ in planned if not p.skipped and p.job_id not in done]
        say(f"estimate, one mutant at a time (this machine, 2 cores): this run {len(pending)} mutants, at most "
            f"{estimate([p for p, _, _ in pending], cmap, sources) / 60:.0f} min; every pending mutant "
            f"{len(whole)}, at most {estimate(whole, cmap, sources) / 3600:.1f} h "
            "(an upper bound: killed mutants stop at the first failure)")
        _run_pending(pending, cmap, out)
        return _report(dbs, out, [s for s, _ in sessions], cmap)
    finally:
        for db in dbs:
            db.close()


def _report(dbs: list, out: Path, sessions: list[Session], cmap: coverage_map.CoverageMap | None) -> Counter[str]:
    found = [v for db in dbs for v in verdicts(db)]
    write_report(found, out, sessions, cmap)
    return Counter(v.fate for v in found)


def _run_pending(pending: list[tuple[Planned, Session, object]], cmap: coverage_map.CoverageMap, out: Path) -> None:
    """Judge each pending mutant, store its result in its session at once (resumable), show progress.

    rich draws the progress line (done/total, killed/survived, ETA): cosmic-ray depends on it, so it
    is always there; one plain line per mutant goes above it, also when the output is a log file.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    counts: Counter[str] = Counter()
    killers: dict[tuple[str, str], list[str]] = {}  # (module, function) -> tests that killed its mutants, latest first
    columns = (TextColumn("mutants"), BarColumn(), MofNCompleteColumn(),
               TextColumn("killed {task.fields[killed]} survived {task.fields[survived]} other {task.fields[other]}"),
               TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns) as progress:
        task = progress.add_task("mutants", total=len(pending), killed=0, survived=0, other=0)
        for index, (p, session, db) in enumerate(pending, 1):
            started = time.monotonic()
            mine = killers.setdefault((p.module, p.function), [])
            verdict = judge_one(p, session, cmap, out / "scratch" / p.job_id, first=tuple(mine))
            db.set_result(p.job_id, _result(verdict))  # type: ignore[attr-defined]
            if verdict.killer:
                mine[:] = [verdict.killer, *(t for t in mine if t != verdict.killer)]
            counts[verdict.fate] += 1
            progress.update(task, advance=1, killed=counts[KILLED], survived=counts[SURVIVED] + counts[UNCOVERED],
                            other=sum(counts.values()) - counts[KILLED] - counts[SURVIVED] - counts[UNCOVERED])
            by = f" by {verdict.killed_by}" if verdict.killed_by else f": {verdict.message}" * bool(verdict.message)
            progress.console.print(
                f"[{index}/{len(pending)}] {verdict.fate}{by} ({time.monotonic() - started:.0f} s, "
                f"{verdict.tests} tests) {verdict.key}", markup=False, highlight=False, soft_wrap=True)


# --- the report ---------------------------------------------------------------------------------

def scores(found: list[Verdict]) -> dict[str, dict[str, dict[str, int]]]:
    """Return counts per module and function: killed, survived, uncovered, equivalent, error."""
    table: dict[str, dict[str, dict[str, int]]] = {}
    for v in found:
        row = table.setdefault(v.module, {}).setdefault(v.function, dict.fromkeys(
            (KILLED, SURVIVED, UNCOVERED, EQUIV, ERROR), 0))
        row[v.fate] += 1
    return table


def score(row: dict[str, int]) -> float | None:
    """Killed over the mutants that could be killed (equivalent and errors left out)."""
    live = row[KILLED] + row[SURVIVED] + row[UNCOVERED]
    return row[KILLED] / live if live else None


def write_report(found: list[Verdict], out: Path, sessions: list[Session],
                 cmap: coverage_map.CoverageMap | None) -> None:
    """``mechanical.json`` (the data) and ``mechanical.md`` (drawn from it) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    data = {"sessions": [str(s.folder) for s in sessions], "coverage_map": cmap.key if cmap else "",
            "coverage_request": cmap.request if cmap else {},
            "summary": dict(Counter(v.fate for v in found)), "scores": scores(found),
            "mutants": [asdict(v) | {"key": v.key} for v in found]}
    (out / "mechanical.json").write_text(json.dumps(data, indent=1))
    (out / "mechanical.md").write_text(markdown(data))


def markdown(data: dict) -> str:
    """The report drawn from ``mechanical.json``'s data: score per file and function, then every survivor,
    and any mutant a test killed though ``EQUIVALENT`` argues it changes nothing (a flaky test shows so)."""
    s = data["summary"]
    lines = ["# make mutants FULL=1", "",
             ", ".join(f"{s.get(k, 0)} {k}" for k in (KILLED, SURVIVED, UNCOVERED, EQUIV, ERROR)) + ".", "",
             "| file | function | killed | survived | uncovered | equivalent | error | score |",
             "|---|---|---|---|---|---|---|---|"]
    for module, funcs in data["scores"].items():
        for function, row in funcs.items():
            sc = score(row)
            lines.append(f"| {module.rsplit('.', 1)[-1]} | `{function}` | {row[KILLED]} | {row[SURVIVED]} | "
                         f"{row[UNCOVERED]} | {row[EQUIV]} | {row[ERROR]} | {'-' if sc is None else f'{sc:.0%}'} |")
    open_ = [m for m in data["mutants"] if m["fate"] in (SURVIVED, UNCOVERED)]
    reach = {m["key"]: equivalent_reason(m["key"], OUT_OF_REACH) for m in open_}
    unexplained = [m for m in open_ if not reach[m["key"]]]
    lines += ["", f"## Open survivors ({len(open_)}: {len(unexplained)} unexplained)", "",
              "Each needs a test that kills it, or an argued entry in `mechanical.EQUIVALENT`; those out of reach "
              "of every test on this machine say why (`mechanical.OUT_OF_REACH`).", ""]
    lines += [f"- `{m['key']}` ({m['operator']}, line {m['line']}, {m['tests']} tests"
              f"{'' if m['fate'] == SURVIVED else ', uncovered'})"
              f"{': out of reach here: ' + reach[m['key']] if reach[m['key']] else ''}" for m in open_]
    equivalent = [m for m in data["mutants"] if m["fate"] == EQUIV]
    if equivalent:
        lines += ["", "## Equivalent (argued)", ""] + [f"- `{m['key']}`: {m['equivalent']}" for m in equivalent]
    doubtful = [m for m in data["mutants"] if m["fate"] == KILLED and m.get("equivalent")]
    if doubtful:
        lines += ["", "## Killed though argued equivalent", "",
                  "A test failed under a mutant argued to change nothing: the argument is wrong, or the test "
                  "is flaky (it failed for another reason). Read the failure, then fix the one at fault.", ""]
        lines += [f"- `{m['key']}`: by `{m['killed_by']}`: {m['message']}" for m in doubtful]
    errors = [m for m in data["mutants"] if m["fate"] == ERROR]
    if errors:
        lines += ["", "## Errors", ""] + [f"- `{m['key']}`: {m['message']}" for m in errors]
    return "\n".join(lines) + "\n"

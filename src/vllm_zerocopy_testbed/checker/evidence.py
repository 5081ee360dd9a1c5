"""A run's evidence: each checker call saved with its inputs and verdict, and judged again offline.

Checkers are pure functions of what they are given; saving what they were given makes a run
re-checkable from its report folder alone (Jepsen keeps a run's history for the same reason).
Layout under ``reports/<run>/evidence/``:

* ``<safe test id>.jsonl.gz``: one JSON record a line (gzip members appended), in call order:
  ``kind: check`` (the registered checker's name, its arguments by name, its verdict) and
  ``kind: judged`` (what a test handed to ``judge``: each verdict, whether a checker call made
  it, whether the test changed it afterwards);
* ``blobs/<sha256>.json.gz``: an argument of 4 KiB or more as JSON (workload records inline as
  ``Record.to_json()``, as in ``results.json``), stored once by content: the same records are
  judged by many tests;
* ``blobs/<sha256>.txt.gz``: log text, only the lines the checker's regex reads (each holds its
  prefix: ``mq-send``, ``mq-timeline``), at most ``MAX_LOG_BYTES`` of them, the latest kept.

``recheck(run_dir)`` re-runs every saved call on the saved inputs and compares the verdicts.
"""

from __future__ import annotations

import collections.abc
import functools
import gzip
import hashlib
import inspect
import json
import logging
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterable, Mapping

from vllm_zerocopy_testbed.checker import Verdict, bitexact, faults, latency, schedule, timeline, timeouts, transport
from vllm_zerocopy_testbed.patches.timeline import TIMELINE_PREFIX
from vllm_zerocopy_testbed.patches.wiretap import WIRE_PREFIX
from vllm_zerocopy_testbed.workload.requests import Event, Record

_log = logging.getLogger(__name__)

EVIDENCE_DIR = "evidence"
BLOBS_DIR = "blobs"
SCHEMA = 1
# Log text kept per argument (before gzip): the latest lines, as a checker judges the run's whole log.
MAX_LOG_BYTES = 8 << 20
# Arguments whose JSON is at least this long go to a blob, stored once however often they are judged.
BLOB_MIN_CHARS = 4096
# A verdict judged outside any test (a session fixture before the first test, a hook after the last).
SESSION = "session"


@dataclass(frozen=True)
class Checker:
    """A checker tests call: its function, and which arguments are log text (argument -> the
    prefixes of the lines its regex reads; every line it can match holds one)."""

    function: Callable[..., Verdict | list[Verdict]]
    log_lines: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


CHECKERS: dict[str, Checker] = {
    "bitexact.check": Checker(bitexact.check),
    "bitexact.across": Checker(bitexact.across),
    "faults.check": Checker(faults.check),
    "latency.check": Checker(latency.check),
    "schedule.check_run": Checker(schedule.check_run),
    "timeline.check_no_overlap": Checker(timeline.check_no_overlap, {"logs": (TIMELINE_PREFIX,)}),
    "timeouts.check": Checker(timeouts.check),
    "transport.check_out_of_band": Checker(transport.check_out_of_band, {"logs": (WIRE_PREFIX,)}),
}


class UnknownChecker(LookupError):
    """A checker name that ``CHECKERS`` does not hold."""


class EvidenceError(ValueError):
    """A run folder whose evidence cannot be read (missing, empty, corrupt)."""


def registered(name: str) -> Checker:
    """Return the registered checker ``name`` (``module.function``, e.g. ``timeouts.check``)."""
    try:
        return CHECKERS[name]
    except KeyError:
        raise UnknownChecker(f"no checker named {name!r}: registered are {', '.join(sorted(CHECKERS))}; add it to "
                             "CHECKERS in checker/evidence.py") from None


# -- saving ------------------------------------------------------------------------------------------
def kept_lines(text: str, prefixes: Iterable[str]) -> str:
    """Return the lines of ``text`` that hold one of ``prefixes``, joined by newlines.

    Lines are split at ``\\n`` only: the checkers' regexes match within a line (``.`` and ``$``
    stop at ``\\n`` alone), so they find in the kept text exactly what they find in the whole."""
    prefixes = tuple(prefixes)
    return "\n".join(line for line in text.split("\n") if any(p in line for p in prefixes))


def capped(text: str, max_bytes: int = MAX_LOG_BYTES) -> tuple[str, int]:
    """Return the latest lines of ``text`` that fit in ``max_bytes`` (UTF-8), and how many were dropped."""
    if len(text.encode()) <= max_bytes:
        return text, 0
    lines = text.split("\n")
    kept: list[str] = []
    size = 0
    for line in reversed(lines):
        size += len(line.encode()) + 1
        if size > max_bytes:
            break
        kept.append(line)
    return "\n".join(reversed(kept)), len(lines) - len(kept)


def safe_name(test_id: str) -> str:
    """A file name for ``test_id`` (its node id): letters, digits, ``.``, ``_`` and ``-`` only."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", test_id).strip("_")[:160] or SESSION


def encode(value: Any) -> Any:
    """Return ``value`` as JSON data: records and events tagged (``$record``, ``$event``) so that
    ``decode`` gives them back as objects; other collections (tuples, sets, views) as lists."""
    if isinstance(value, Record):
        return {"$record": value.to_json()}
    if isinstance(value, Event):
        return {"$event": value.to_json()}
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, collections.abc.Mapping):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"a mapping with keys other than str cannot be saved: {list(value)[:3]}")
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, collections.abc.Iterable) and not isinstance(value, (bytes, bytearray)):
        return [encode(v) for v in value]
    raise TypeError(f"a {type(value).__name__} cannot be saved as evidence: teach evidence.encode to write it")


def verdict_json(verdict: Verdict) -> dict[str, Any]:
    """Return a verdict as JSON data (figures' numpy scalars as Python numbers)."""
    return json.loads(json.dumps({"checker": verdict.checker, "ok": verdict.ok, "problems": list(verdict.problems),
                                  "figures": dict(verdict.figures)}, default=_number))


def _number(value: Any) -> Any:
    if hasattr(value, "item"):  # a numpy scalar
        return value.item()
    raise TypeError(f"a {type(value).__name__} in a verdict's figures cannot be saved")


def _gzip_write(path: Path, data: bytes) -> None:
    if path.exists():
        return
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(gzip.compress(data, compresslevel=6, mtime=0))
    temporary.replace(path)


class Recorder:
    """Saves the registered checker calls and the judged verdicts of one run under ``run_dir/evidence``.

    ``start(test_id)`` names the test that later calls belong to (``live/plugin.py`` calls it for
    every test). Nothing is written before the first call."""

    def __init__(self, run_dir: Path, test_id: str = SESSION) -> None:
        self.run_dir = run_dir
        self.test_id = test_id
        self._made: list[tuple[Verdict, str]] = []  # verdicts checker calls of this test made, as made
        self._lock = threading.Lock()

    @property
    def folder(self) -> Path:
        return self.run_dir / EVIDENCE_DIR

    def start(self, test_id: str | None) -> None:
        """Attribute what is saved from now on to ``test_id`` (None: to the session)."""
        self.test_id = test_id or SESSION
        self._made.clear()

    def judged(self, name: str, /, *args: Any, **kwargs: Any) -> Any:
        """Return what the registered checker ``name`` says on these arguments (a ``Verdict``, or the
        list ``schedule.check_run`` gives), having saved the call and its verdict. ``name`` is
        positional only: a checker may take a ``name`` of its own (``bitexact.check``).

        The checker judges the arguments as given (log text whole); what is saved is what
        ``recheck`` judges again: the log lines the checker reads, the rest as JSON."""
        entry = registered(name)
        bound = inspect.signature(entry.function).bind(*args, **kwargs)
        arguments = {k: list(v) if isinstance(v, collections.abc.Iterator) else v for k, v in bound.arguments.items()}
        result = entry.function(**arguments)
        verdicts = result if isinstance(result, list) else [result]
        saved = [verdict_json(v) for v in verdicts]
        with self._lock:
            self._made.extend((v, json.dumps(s, sort_keys=True)) for v, s in zip(verdicts, saved))
            record: dict[str, Any] = {"schema": SCHEMA, "kind": "check", "test": self.test_id, "checker": name}
            try:
                record["arguments"] = {k: self._save_argument(entry, k, v) for k, v in arguments.items()}
            except (TypeError, ValueError, OSError) as exc:  # saving evidence must never change a test's outcome
                _log.exception("evidence: the inputs of %s in %s were not saved", name, self.test_id)
                record["unsaved"] = f"{type(exc).__name__}: {exc}"
            record.update({"verdicts": saved} if isinstance(result, list) else {"verdict": saved[0]})
            self._append(record)
        return result

    def given(self, verdicts: Iterable[Verdict]) -> None:
        """Save what a test judged: each verdict as it stands, whether a checker call of this test
        made it (``from``: ``check`` or ``test``), and whether the test changed it since (``amended``)."""
        with self._lock:
            entries = []
            for verdict in verdicts:
                now = verdict_json(verdict)
                made = next((snapshot for v, snapshot in self._made if v is verdict), None)
                entries.append({"verdict": now, "from": "test" if made is None else "check",
                                "amended": made is not None and made != json.dumps(now, sort_keys=True)})
            self._append({"schema": SCHEMA, "kind": "judged", "test": self.test_id, "verdicts": entries})

    def module(self, module: ModuleType) -> "RecordedModule":
        """Return ``module`` (a checker module) with its registered checkers saving every call."""
        return RecordedModule(self, module)

    def _save_argument(self, entry: Checker, name: str, value: Any) -> Any:
        if name in entry.log_lines:
            if not isinstance(value, str):
                raise TypeError(f"argument {name!r} is log text, got a {type(value).__name__}")
            total = value.count("\n") + 1
            text, cut = capped(kept_lines(value, entry.log_lines[name]), MAX_LOG_BYTES)
            if cut:
                _log.warning("evidence: %d log lines past %d bytes not saved for %s (%s)", cut, MAX_LOG_BYTES,
                             self.test_id, name)
            return {"$log": self._blob(text.encode(), "txt"), "lines": text.count("\n") + 1 if text else 0,
                    "of_lines": total, "cut": cut}
        data = encode(value)
        text = json.dumps(data)
        if len(text) < BLOB_MIN_CHARS:
            return data
        return {"$blob": self._blob(text.encode(), "json")}

    def _blob(self, data: bytes, suffix: str) -> str:
        digest = hashlib.sha256(data).hexdigest()
        folder = self.folder / BLOBS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        _gzip_write(folder / f"{digest}.{suffix}.gz", data)
        return digest

    def _append(self, record: dict[str, Any]) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with gzip.open(self.folder / f"{safe_name(record['test'])}.jsonl.gz", "at", encoding="utf-8") as out:
                out.write(json.dumps(record, default=_number) + "\n")
        except OSError:  # a full disk loses the evidence, never the test's outcome
            _log.exception("evidence: a %s record of %s was not written", record["kind"], record["test"])


class RecordedModule:
    """A checker module whose registered checkers save each call (``Recorder.judged``); any other
    name (``bitexact.first_answers``, ``timeline.summarize``) is the module's own."""

    def __init__(self, recorder: Recorder, module: ModuleType) -> None:
        self._recorder = recorder
        self._module = module
        self._prefix = module.__name__.rsplit(".", 1)[-1]

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._module, name)
        qualified = f"{self._prefix}.{name}"
        if qualified not in CHECKERS:
            return attribute

        @functools.wraps(attribute)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            return self._recorder.judged(qualified, *args, **kwargs)

        return recorded


def judged(run_dir: Path, test_id: str, name: str, /, *args: Any, **kwargs: Any) -> Any:
    """Return checker ``name``'s verdict on the arguments, its call saved under ``run_dir/evidence``
    as ``test_id``'s (e.g. ``judged(run, "t", "transport.check_out_of_band", logs=..., tensor_bytes=...)``)."""
    return Recorder(run_dir, test_id).judged(name, *args, **kwargs)


# -- judging again ------------------------------------------------------------------------------------
def _read_blob(folder: Path, digest: str, suffix: str) -> str:
    path = folder / BLOBS_DIR / f"{digest}.{suffix}.gz"
    try:
        return gzip.decompress(path.read_bytes()).decode()
    except (OSError, EOFError) as exc:
        raise EvidenceError(f"{path}: unreadable ({exc})") from None


def decode(value: Any, folder: Path) -> Any:
    """Return saved argument data as the checker takes it: records, events, blobs and logs resolved."""
    if isinstance(value, list):
        return [decode(v, folder) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {"$record"}:
        return Record(**value["$record"])
    if set(value) == {"$event"}:
        return Event(**value["$event"])
    if set(value) == {"$blob"}:
        return decode(json.loads(_read_blob(folder, value["$blob"], "json")), folder)
    if "$log" in value:
        return _read_blob(folder, value["$log"], "txt")
    return {k: decode(v, folder) for k, v in value.items()}


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """Return every saved record of a run, file by file in name order, each in call order."""
    if not run_dir.is_dir():
        raise EvidenceError(f"{run_dir}: no such run folder (reports/<run>/, as make e2e names it)")
    files = sorted((run_dir / EVIDENCE_DIR).glob("*.jsonl.gz"))
    records: list[dict[str, Any]] = []
    for path in files:
        try:
            with gzip.open(path, "rt", encoding="utf-8") as lines:
                records += [json.loads(line) for line in lines if line.strip()]
        except (OSError, EOFError, json.JSONDecodeError) as exc:
            raise EvidenceError(f"{path}: unreadable ({exc})") from None
    if not any(r.get("kind") == "check" for r in records):
        raise EvidenceError(f"{run_dir}: no evidence saved ({EVIDENCE_DIR}/*.jsonl.gz with a checker call): a run "
                            "made before evidence was recorded, or one that judged nothing")
    return records


@dataclass
class Rejudged:
    """One saved checker call judged again: its verdicts as saved and as given now."""

    test: str
    checker: str
    saved: list[dict[str, Any]]
    now: list[dict[str, Any]]
    cut: int = 0  # log lines the size cap left out

    @property
    def same(self) -> bool:
        return [json.dumps(v, sort_keys=True) for v in self.saved] == [json.dumps(v, sort_keys=True) for v in self.now]

    def difference(self) -> str:
        """The first thing that differs: a problem only one side has, else ok or a figure."""
        for saved, now in zip(self.saved, self.now):
            new = [p for p in now["problems"] if p not in saved["problems"]]
            gone = [p for p in saved["problems"] if p not in now["problems"]]
            if new:
                return f"{now['checker']}: {new[0].splitlines()[0]}"
            if gone:
                return f"{saved['checker']}: no longer: {gone[0].splitlines()[0]}"
            if saved != now:
                keys = sorted(set(saved["figures"]) | set(now["figures"]))
                key = next((k for k in keys if saved["figures"].get(k) != now["figures"].get(k)), None)
                if key is not None:
                    return f"{now['checker']}: figure {key} {saved['figures'].get(key)} -> {now['figures'].get(key)}"
                return f"{saved['checker']} -> {now['checker']}"
        return f"{len(self.saved)} verdict(s) saved, {len(self.now)} now"


@dataclass
class TestRecheck:
    """A test's saved checker calls judged again, and the verdicts it built itself (not re-checkable)."""

    __test__ = False

    test: str
    calls: list[Rejudged] = field(default_factory=list)
    built: int = 0  # verdicts the test judged that no registered checker made
    amended: int = 0  # checker verdicts the test changed before judging them
    unsaved: list[str] = field(default_factory=list)  # checker calls whose inputs could not be saved: why

    @property
    def same(self) -> bool:
        return all(c.same for c in self.calls) and not self.unsaved


def _rejudge(record: dict[str, Any], folder: Path) -> Rejudged:
    entry = registered(record["checker"])
    arguments = {k: decode(v, folder) for k, v in record["arguments"].items()}
    result = entry.function(**arguments)
    now = [verdict_json(v) for v in (result if isinstance(result, list) else [result])]
    saved = record["verdicts"] if "verdicts" in record else [record["verdict"]]
    cut = sum(v.get("cut", 0) for v in record["arguments"].values() if isinstance(v, dict) and "$log" in v)
    return Rejudged(record["test"], record["checker"], saved, now, cut)


def recheck(run_dir: Path) -> list[TestRecheck]:
    """Judge every saved checker call of a run again on its saved inputs; one entry per test, by test id.

    Raises ``EvidenceError`` where nothing can be judged, ``UnknownChecker`` for a name no
    longer registered."""
    folder = run_dir / EVIDENCE_DIR
    tests: dict[str, TestRecheck] = {}
    for record in read_records(run_dir):
        test = tests.setdefault(record.get("test", SESSION), TestRecheck(record.get("test", SESSION)))
        if record.get("kind") == "check" and "unsaved" in record:
            test.unsaved.append(f"{record['checker']}: {record['unsaved']}")
        elif record.get("kind") == "check":
            try:
                test.calls.append(_rejudge(record, folder))
            except (KeyError, TypeError) as exc:
                raise EvidenceError(f"{test.test}: a saved {record.get('checker')} call cannot be judged again "
                                    f"({type(exc).__name__}: {exc})") from None
        elif record.get("kind") == "judged":
            test.built += sum(1 for v in record["verdicts"] if v["from"] == "test")
            test.amended += sum(1 for v in record["verdicts"] if v["amended"])
    return [tests[k] for k in sorted(tests)]


def _outcome(verdicts: Iterable[dict[str, Any]]) -> str:
    verdicts = list(verdicts)
    failed = sum(not v["ok"] for v in verdicts)
    return "ok" if not failed else f"FAIL {failed}/{len(verdicts)}"


def lines(results: list[TestRecheck]) -> list[str]:
    """One line per test (SAME/DIFFERENT, test id, saved and new verdicts; what differs first),
    then the summary line."""
    out = []
    for test in results:
        saved = _outcome(v for c in test.calls for v in c.saved)
        now = _outcome(v for c in test.calls for v in c.now)
        extra = [f"{test.built} built in the test"] if test.built else []
        extra += [f"{test.amended} amended in the test"] if test.amended else []
        note = f" ({', '.join(extra)}: not re-checkable)" if extra else ""
        if test.unsaved:
            out.append(f"UNSAVED    {test.test}  inputs not saved, cannot judge again: {test.unsaved[0]}")
            continue
        if not test.calls:
            out.append(f"UNCHECKED  {test.test}  no checker call saved{note}")
            continue
        different = next((c for c in test.calls if not c.same), None)
        if different is None:
            out.append(f"SAME       {test.test}  saved {saved}  now {now}{note}")
        else:
            cut = f" [{different.cut} log lines were past the size cap]" if different.cut else ""
            out.append(f"DIFFERENT  {test.test}  saved {saved}  now {now}: {different.difference()}{cut}")
    calls = [c for t in results for c in t.calls]
    different = sum(not c.same for c in calls)
    built = sum(t.built + t.amended for t in results)
    unsaved = sum(len(t.unsaved) for t in results)
    out.append(f"{len(results)} tests, {len(calls)} checker calls judged again: {len(calls) - different} same, "
               f"{different} different in {sum(not t.same for t in results)} test(s)"
               + (f"; {built} verdict(s) built or amended in tests, not re-checkable" if built else "")
               + (f"; {unsaved} call(s) whose inputs were not saved" if unsaved else ""))
    return out

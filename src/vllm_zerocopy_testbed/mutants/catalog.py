"""The regressions ``make mutants`` plants, one small change each, and the suite that should catch it.

Each mutant is a change someone could plausibly make to the code under test: vLLM's
``shm_broadcast.py`` (reducer, rebuild, ring protocol, overflow rule, remote receive),
``ray_utils.py``'s detach and its call site, and the testbed's own patches (release wait,
detach, inflight cap). It runs in the mode that exercises the changed code (``-k`` picks
that mode's parametrisation; the mode variables stay unset, so known failures keep their
table entry and signature) and against the cheapest tests that should see it, fastest first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_zerocopy_testbed.mutants.overlay import Replacement

SHM = "vllm.distributed.device_communicators.shm_broadcast"
RAY_UTILS = "vllm.v1.executor.ray_utils"
RAY_EXECUTOR = "vllm.v1.executor.ray_executor"
BROADCAST = "vllm_zerocopy_testbed.patches.broadcast"
DETACH = "vllm_zerocopy_testbed.patches.detach"
INFLIGHT = "vllm_zerocopy_testbed.patches.inflight"
ARENA = "vllm_zerocopy_testbed.patches.arena"
SHM_ARENA = "vllm.distributed.device_communicators.shm_tensor_arena"

MQ = "tests/component/test_message_queue.py"
MQ_RING = "tests/component/test_message_queue_ring.py"
REDUCER = "tests/unit/test_broadcast_reducer.py"
SEND = "tests/unit/test_broadcast_send.py"
DETACH_UNIT = "tests/unit/test_detach.py"
RAY_DETACH = "tests/component/test_ray_detach.py"
DEADLOCK = "tests/component/test_cgraph_deadlock.py"
TENSOR_ARENA = "tests/component/test_tensor_arena.py"
TIMING = "tests/component/test_message_queue_timing.py"


@dataclass(frozen=True)
class Mutant:
    """One planted regression: where, what changes, why it is realistic, and who should catch it."""

    name: str
    module: str
    old: str
    new: str
    regression: str  # what a developer would have done, in words
    tests: tuple[str, ...]  # pytest paths or node ids, cheapest first
    select: str = ""  # pytest -k: the mode that runs the changed code
    # Why the mutant cannot change behaviour (only cost), when it is argued equivalent.
    equivalent: str = ""
    changes: tuple[Replacement, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "changes", (Replacement(self.module, self.old, self.new),))

    @property
    def target(self) -> str:
        return "vllm" if self.module.startswith("vllm.") else "testbed"


MUTANTS: tuple[Mutant, ...] = (
    # --- vLLM's shm_broadcast.py, run under `upstream` ------------------------------------
    Mutant("reducer-falls-back-to-torch", SHM,
           "            return _rebuild_tensor, (PickleBuffer(raw), tuple(tensor.shape), dtype_str)",
           "            return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)",
           "the reducer hands every tensor to torch's copying reduction (PR 48442 undone)",
           (MQ + "::test_tensors_above_the_limit_travel_out_of_band", MQ + "::test_fp8_tensors_cross_the_queue"),
           "upstream"),
    Mutant("rebuild-keeps-read-only-bytes", SHM,
           "    raw = buf if isinstance(buf, bytearray) else bytearray(buf)",
           "    raw = buf",
           "rebuild aliases an in-band `bytes` buffer instead of copying it: a read-only tensor",
           (MQ + "::test_every_reader_gets_bit_exact_writable_tensors",), "upstream",
           equivalent="no MessageQueue message reaches the changed line with `bytes`: pickle writes an in-band "
           "buffer as `bytes` only when it is read-only, and `_reduce_tensor` exposes tensors through `.numpy()`, "
           "which is always writable (in band: `bytearray`); the ring hands `bytearray`s and ZMQ writable frames. "
           "Same behaviour, same cost (no copy is added or removed)"),
    Mutant("rebuild-copies-zmq-frames", SHM,
           "    if isinstance(buf, zmq.Frame):",
           "    if False:  # isinstance(buf, zmq.Frame)",
           "rebuild copies a ZMQ frame instead of aliasing it: zero copy lost at remote readers",
           (REDUCER,), "upstream"),
    Mutant("ring-slot-aliased", SHM,
           "                        all_buffers.append(buffer if i == 0 else bytearray(buffer))",
           "                        all_buffers.append(buffer)",
           "dequeue passes ring views to pickle: an out-of-band array aliases a ring slot that is reused",
           (MQ_RING,), "upstream"),
    Mutant("overflow-rule-forgets-the-stream", SHM,
           "            if total_bytes + len(all_buffers[0]) >= self.buffer.max_chunk_bytes:",
           "            if total_bytes >= self.buffer.max_chunk_bytes:",
           "the overflow rule counts out-of-band buffers only: a large in-band stream overruns the chunk",
           (MQ_RING,), "upstream"),
    Mutant("overflow-flag-lost", SHM,
           "                    buf[0] = 1  # overflow",
           "                    buf[0] = 0  # overflow",
           "the overflow marker is not written: local readers parse an empty ring chunk",
           (MQ + "::test_every_reader_gets_bit_exact_writable_tensors",), "upstream and overflow"),
    Mutant("remote-receive-ignores-timeout", SHM,
           "        if not socket.poll(timeout=timeout_ms):",
           "        if not socket.poll(timeout=None):",
           "a remote reader's dequeue waits without its bound",
           (MQ_RING,), "upstream"),
    Mutant("reader-never-marks-read", SHM,
           "                        metadata_buffer[self.local_reader_rank + 1] = 1",
           "                        pass",
           "a local reader does not set its read flag: the writer cannot reuse a slot once the ring wrapped",
           (MQ_RING,), "upstream"),
    Mutant("writer-keeps-read-flags", SHM,
           "                    metadata_buffer[i] = 0",
           "                    pass",
           "the writer does not clear the read flags of a slot it rewrites: readers skip the new message",
           (MQ_RING,), "upstream"),
    Mutant("remote-send-copies", SHM,
           "            self.remote_socket.send_multipart(all_buffers, copy=False)",
           "            self.remote_socket.send_multipart(all_buffers, copy=True)",
           "upstream fixes PR 53217 by copying (a silent behaviour change the known-failure table must notice)",
           (MQ + "::test_mutating_after_enqueue_never_reaches_readers",), "upstream and remote"),
    # --- regressions that need a writer ahead of its readers, an idle reader, many frees
    # between two reads, or a threshold probed from both sides to show -------------------
    Mutant("writer-waits-for-one-reader", SHM,
           "                    return not (written_flag and read_count != self.buffer.n_reader)",
           "                    return not (written_flag and read_count == 0)",
           "the writer reuses a ring slot once any reader read it, not every reader: a slow reader loses messages",
           (TIMING + "::test_a_writer_ahead_of_readers_at_different_speeds_loses_nothing",), "upstream"),
    Mutant("writer-overruns-the-ring", SHM,
           "                    return not (written_flag and read_count != self.buffer.n_reader)",
           "                    return True",
           "the writer never waits for its readers: with all of them busy it overwrites unread slots",
           (TIMING + "::test_a_writer_ahead_of_every_reader_stops_at_a_full_ring",), "upstream"),
    Mutant("writer-forgets-to-notify", SHM,
           "            self._spin_condition.notify()",
           "            pass  # readers find the message when they next look",
           "the writer does not wake idle readers: a reader idle past its busy loop waits for its 5 s recheck",
           (TIMING + "::test_a_reader_idle_past_its_busy_loop_wakes_at_the_next_message",), "upstream"),
    Mutant("oob-limit-inclusive", SHM,
           "            if len(raw_buf) < 1024 * 1024:",
           "            if len(raw_buf) <= 1024 * 1024:",
           "a buffer of exactly 1 MiB stays in the pickle stream (copied) instead of going out of band",
           (TIMING + "::test_a_tensor_leaves_the_stream_at_exactly_one_mib",), "upstream"),
    Mutant("overflow-too-early", SHM,
           "            if total_bytes + len(all_buffers[0]) >= self.buffer.max_chunk_bytes:",
           "            if total_bytes + len(all_buffers[0]) + 4 >= self.buffer.max_chunk_bytes:",
           "the overflow rule counts the length prefix twice: messages that fit the chunk go through the socket",
           (TIMING + "::test_the_ring_holds_a_message_up_to_its_chunk_and_overflows_one_byte_past_it",), "upstream"),
    # --- vLLM's shm_tensor_arena.py, run under `upstream` ----------------------------------
    Mutant("arena-flush-retires-one", SHM_ARENA,
           "        while self._pending_release:",
           "        if self._pending_release:",
           "a reader's flush retires one freed slot per dequeue: slots freed together come back one step at a time",
           (TENSOR_ARENA + "::test_many_frees_between_two_reads_release_every_slot",), "upstream"),
    Mutant("arena-flush-rebinds-the-list", SHM_ARENA,
           "        idxs = []\n        while self._pending_release:\n            idxs.append(self._pending_release.pop())",
           "        idxs, self._pending_release = self._pending_release, []",
           "the flush swaps in a new pending list: tensors received before it queue their release on the old one",
           (TENSOR_ARENA + "::test_slots_freed_out_of_order_around_other_frees_all_come_back",), "upstream"),
    Mutant("arena-slot-limit-exclusive", SHM_ARENA,
           "        if nbytes > self.slot_bytes:",
           "        if nbytes >= self.slot_bytes:",
           "a tensor exactly as large as a slot no longer takes one",
           (TENSOR_ARENA + "::test_a_tensor_as_large_as_a_slot_takes_one_and_a_byte_more_does_not",), "upstream"),
    Mutant("arena-slot-free-once-one-reader-done", SHM_ARENA,
           "                free = meta[0] == 0 or sum(meta[1:]) == self.n_reader",
           "                free = meta[0] == 0 or sum(meta[1:]) >= 1",
           "a slot is rewritten once one reader freed it: a slower reader reads the next tensor's bytes",
           (TENSOR_ARENA + "::test_a_writer_ahead_of_slow_readers_through_the_arena_loses_nothing",), "upstream"),
    # --- vLLM's ray_utils.py: the detach and its call site, run under `upstream` -----------
    Mutant("detach-forgets-an-array", RAY_UTILS,
           "        logprobs_c = _copy_if_readonly(logprobs)",
           "        logprobs_c = logprobs",
           "one of the three logprobs arrays is left channel-backed",
           (DETACH_UNIT, RAY_DETACH + "::test_held_logprobs_never_stall_the_channel"), "upstream"),
    Mutant("detach-copies-writable-arrays", RAY_UTILS,
           "        if isinstance(arr, np.ndarray) and not arr.flags.writeable:",
           "        if isinstance(arr, np.ndarray) and arr.flags.writeable:",
           "the read-only test is inverted: channel arrays stay, owned ones are copied",
           (DETACH_UNIT, RAY_DETACH + "::test_held_logprobs_never_stall_the_channel"), "upstream"),
    Mutant("detach-drops-its-copies", RAY_UTILS,
           "            output.logprobs = type(output.logprobs)(",
           "            _copies = type(output.logprobs)(",
           "the copies are made but not stored back on the output",
           (DETACH_UNIT, RAY_DETACH + "::test_held_logprobs_never_stall_the_channel"), "upstream"),
    Mutant("future-skips-detach", RAY_UTILS,
           "            detach_zero_copy_from_model_runner_output(outputs)\n            return outputs",
           "            return outputs",
           "FutureWrapper.result (the engine's non-blocking read, PP) no longer detaches",
           (RAY_DETACH + "::test_held_logprobs_never_stall_the_channel",), "upstream"),
    Mutant("executor-blocking-read-skips-detach", RAY_EXECUTOR,
           "                output = refs[0].get()\n                detach_zero_copy_from_model_runner_output(output)",
           "                output = refs[0].get()",
           "the compiled-graph executor's blocking read (non_block=False) no longer detaches",
           (RAY_DETACH + "::test_held_logprobs_never_stall_the_channel",), "upstream"),
    # --- the testbed's broadcast patch, run under `testbed` --------------------------------
    # --- the testbed's arena patch, run under `testbed` -------------------------------------
    Mutant("testbed-arena-maps-the-slot-shared", ARENA,
           "flags=mmap.MAP_PRIVATE,",
           "flags=mmap.MAP_SHARED,",
           "the reader maps the slot shared (as vLLM's view does): one reader's write is every reader's",
           (TENSOR_ARENA + "::test_a_reader_write_stays_its_own",), "testbed"),
    Mutant("testbed-arena-keeps-failed-claims", ARENA,
           "            free_unpublished(self, before)\n",
           "",
           "a failed enqueue's slots are not given back: each failure takes one of the 8 for good",
           (TENSOR_ARENA + "::test_a_failed_enqueue_leaks_no_slot",), "testbed"),
    Mutant("testbed-arena-queues-left-to-vllm", BROADCAST,
           "        frames = serialize(obj, policy.zero_copy_tensors, getattr(self, \"tensor_arena\", None))\n",
           "        if getattr(self, \"tensor_arena\", None) is not None:\n            return _installed_enqueue(self, obj, timeout)\n"
           "        frames = serialize(obj, policy.zero_copy_tensors, getattr(self, \"tensor_arena\", None))\n",
           "arena queues handed back to vLLM's enqueue: their overflow races again (upstream PR 53217)",
           (MQ + "::test_mutating_after_enqueue_never_reaches_readers",), "testbed and arena"),
    Mutant("testbed-returns-before-release", BROADCAST,
           "TESTBED_POLICY = EnqueuePolicy(PatchMode.TESTBED, zero_copy_tensors=True, hold_until_sent=True)",
           "TESTBED_POLICY = EnqueuePolicy(PatchMode.TESTBED, zero_copy_tensors=True, hold_until_sent=False)",
           "enqueue returns without waiting for ZMQ's release: the 53217 race is back",
           (MQ + "::test_mutating_after_enqueue_never_reaches_readers",), "testbed"),
    Mutant("testbed-watches-the-callers-buffer", BROADCAST,
           "        parts.append(view)",
           "        parts.append(buffer)",
           "the weak reference watches a view ZMQ never holds: released at once, the race is back",
           (MQ + "::test_mutating_after_enqueue_never_reaches_readers",), "testbed"),
    Mutant("testbed-release-wait-unbounded", BROADCAST,
           "    return time.monotonic() + float(envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)",
           "    return float(\"inf\")",
           "with timeout=None (vLLM's executors) the release wait has no bound: a stopped reader hangs the writer",
           (SEND,)),
    Mutant("testbed-ring-size-without-headers", BROADCAST,
           "    return _RING_HEADER_BYTES + sum(_RING_LENGTH_BYTES + memoryview(f).nbytes for f in frames)",
           "    return sum(memoryview(f).nbytes for f in frames)",
           "the ring size forgets the headers: a message within a few bytes of the chunk size overruns it",
           (MQ_RING,), "testbed"),
    Mutant("testbed-reducer-drops-the-conj-check", BROADCAST,
           "        and not tensor.is_conj()\n",
           "",
           "conjugate tensors take the raw-bytes path: the conjugate bit is lost",
           (REDUCER,), ""),
    Mutant("testbed-rebuild-aliases-read-only", BROADCAST,
           "    if view.readonly:\n        view = memoryview(bytearray(view))\n",
           "",
           "the rebuild aliases read-only buffers: tensors readers cannot write",
           (REDUCER,), ""),
    # --- the testbed's detach and inflight patches -----------------------------------------
    Mutant("testbed-detach-skips-tuples", DETACH,
           "_ATOMS = (type(None), bool, int, float, complex, str, bytes)",
           "_ATOMS = (type(None), bool, int, float, complex, str, bytes, tuple)",
           "tuples treated as atoms (immutable, so 'nothing to copy'): LogprobsLists is a tuple",
           (DETACH_UNIT,), "not upstream and not off"),
    Mutant("testbed-detach-fast-path-reads-one-item", DETACH,
           "    return set(map(type, items)) <= _ATOM_TYPES",
           "    return next(iter(map(type, items)), type(None)) in _ATOM_TYPES",
           "the atom fast path looks at the first item only: an array later in the list is missed",
           (DETACH_UNIT,), "not upstream and not off"),
    Mutant("testbed-detach-skips-named-tuples", DETACH,
           "    if issubclass(declared, tuple) and hasattr(declared, \"_fields\"):\n        return _named_tuple(declared)",
           "    if issubclass(declared, tuple) and hasattr(declared, \"_fields\"):\n        return None",
           "the type plan treats named tuples as plain values: LogprobsLists and SamplingMaskLists stay behind",
           (DETACH_UNIT,), "not upstream and not off"),
    Mutant("testbed-detach-trusts-object", DETACH,
           "    if not isinstance(declared, type) or declared is object:\n        return _by_runtime_type",
           "    if not isinstance(declared, type) or declared is object:\n        return None",
           "a field declared `object` or `Any` is skipped: auxiliary rows (`dict[str, object]`) stay behind",
           (DETACH_UNIT,), "not upstream and not off"),
    Mutant("testbed-detach-row-loop-drops-the-copy", DETACH,
           "                    item.{field} = rows.copy()",
           "                    rows.copy()",
           "the generated per-class loop copies the rows but does not store the copy",
           (DETACH_UNIT,), "not upstream and not off"),
    Mutant("testbed-detach-row-loop-drops-other-types", DETACH,
           "        for item in others:\n",
           "        for item in others[:0]:\n",
           "after the generated loop, items of other types than the first are forgotten",
           (DETACH_UNIT,), "not upstream and not off"),
    Mutant("testbed-detach-sets-frozen-fields", DETACH,
           "    if not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]\n",
           "    if True:\n",
           "frozen dataclasses changed in place: FrozenInstanceError on an output field vLLM adds",
           (DETACH_UNIT,), "not upstream and not off"),
    Mutant("testbed-inflight-cap-lost", INFLIGHT,
           "            return 1\n",
           "            return value\n",
           "the inflight patch logs the cap but keeps vLLM's value: the compiled-graph deadlock is back",
           (DEADLOCK + "::test_the_compiled_graph_never_deadlocks_the_driver_node",), "testbed"),
    Mutant("testbed-inflight-ignores-tp", INFLIGHT,
           "parallel.pipeline_parallel_size >= 2 and parallel.tensor_parallel_size >= 2\n",
           "parallel.pipeline_parallel_size >= 2 and parallel.tensor_parallel_size >= 1\n",
           "the cap also applies at TP=1, where nothing deadlocks: PP overlap lost for nothing",
           (DETACH_UNIT + "::test_one_execution_in_flight_only_for_compiled_graphs_with_pp_and_tp",), ""),
    Mutant("testbed-inflight-ignores-its-mode", INFLIGHT,
           "        if value > 1 and _mode is PatchMode.TESTBED and needed(self):",
           "        if value > 1 and needed(self):",
           "the cap applies whatever TESTBED_INFLIGHT says once it was installed",
           (DETACH_UNIT + "::test_the_inflight_mode_switches_both_ways_on_a_real_vllm_config",)),
    Mutant("testbed-inflight-counts-one-node-as-several", INFLIGHT,
           "    return sum(1 for node in ray.nodes() if node.get(\"Alive\")) > 1",
           "    return sum(1 for node in ray.nodes() if node.get(\"Alive\")) > 0",
           "a one-node Ray cluster (no raylet hop, no deadlock) loses its PP overlap too",
           (DEADLOCK + "::test_one_ray_node_keeps_vllms_pipelining",)),
)


def by_name(names: list[str]) -> list[Mutant]:
    """Return the named mutants (all when ``names`` is empty); a ValueError names the valid ones."""
    if not names:
        return list(MUTANTS)
    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown mutants {unknown}; `make mutants LIST=1` lists them")
    return [known[n] for n in names]

"""Which tests a side runs, and the property and path each one judges.

Only tests that run vLLM's own code when every mode is ``upstream`` are selected: a test of the
testbed's replacement (its reducer, its release wait, its detach) says nothing about the change
under check. Left out on purpose:

- ``tests/unit/test_broadcast_send.py``: the testbed's ``_send`` and raw ZMQ, no vLLM code;
- ``tests/unit/test_broadcast_reducer.py`` but its ``[upstream]`` rebuild test: the testbed's reducer;
- ``test_ray_detach.py::test_a_stall_is_bounded_by_the_channel_timeout``: it drives mode ``off``;
- the other ``tests/unit/test_detach.py`` tests: the testbed's detach and in-flight cap.

A test that calls ``expect(property, mode)`` names its property in junit.xml (``tests/conftest.py``
records it); the others take theirs from ``OWN_PROPERTY`` or their file's default here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vllm_zerocopy_testbed.config import REPO_ROOT

# Paths of the table: the MessageQueue broadcast (ring, overflow socket, remote TCP), its shared-memory
# ring, vLLM 0.32's tensor arena, the Ray output detach; e2e: the compose cluster's suites.
PATHS = ("broadcast", "ring", "arena", "detach", "e2e")


@dataclass(frozen=True)
class SuiteFile:
    """One test file: the path it judges and the property of its tests that name none."""

    path: str
    property: str


FILES: dict[str, SuiteFile] = {
    "tests/component/test_message_queue.py": SuiteFile("broadcast", "bit_exact"),
    "tests/component/test_message_queue_ring.py": SuiteFile("ring", "ring_protocol"),
    "tests/component/test_tensor_arena.py": SuiteFile("arena", "arena_lifecycle"),
    "tests/component/test_ray_detach.py": SuiteFile("detach", "detach_logprobs"),
    "tests/component/test_grammar_bitmask.py": SuiteFile("broadcast", "race_free_ndarray"),
    "tests/unit/test_broadcast_reducer.py": SuiteFile("broadcast", "zero_copy_receive"),
    "tests/unit/test_detach.py": SuiteFile("detach", "detach_call_site"),
}

# Tests that call no ``expect`` but judge a property of their own (by function name).
OWN_PROPERTY = {
    "test_readers_get_bit_exact_writable_tensors_at_every_size_and_dtype": "bit_exact",
    "test_a_tensor_rebuilt_from_a_received_zmq_frame_aliases_it": "zero_copy_receive",
    "test_apply_replaces_the_function_vllm_calls": "detach_call_site",
}

# What each side runs (pytest node ids and files).
COMPONENT_TESTS = (
    "tests/component/test_message_queue.py",
    "tests/component/test_message_queue_ring.py",
    "tests/component/test_tensor_arena.py",
    "tests/component/test_ray_detach.py::test_held_logprobs_never_stall_the_channel",
    "tests/component/test_ray_detach.py::test_held_sampling_masks_never_stall_the_channel",
    "tests/component/test_ray_detach.py::test_every_worker_output_is_detached_before_the_kv_aggregator_merges_them",
    "tests/component/test_ray_detach.py::test_only_the_output_rank_s_output_reaches_the_scheduler",
    "tests/unit/test_broadcast_reducer.py::test_a_tensor_rebuilt_from_a_received_zmq_frame_aliases_it[upstream]",
    "tests/unit/test_broadcast_reducer.py::test_rebuilt_tensor_is_writable_and_aliases_only_writable_buffers[upstream]",
    "tests/unit/test_detach.py::test_every_read_only_array_is_copied_with_values_and_types_kept",
    "tests/unit/test_detach.py::test_sampling_masks_are_detached",
    "tests/unit/test_detach.py::test_auxiliary_rows_are_detached",
    "tests/unit/test_detach.py::test_apply_replaces_the_function_vllm_calls",
)

# FULL=1 only: the send race on the engine's real grammar bitmask (xgrammar over a 262144-token tokenizer,
# built per run: ~90 s a side on 2 cores); the quick tier judges the same property on the same paths.
FULL_TESTS = ("tests/component/test_grammar_bitmask.py",)

E2E_PATH = "e2e"


def function_name(nodeid: str) -> str:
    """``tests/x.py::test_a[p-q]`` -> ``test_a``."""
    return nodeid.rpartition("::")[2].partition("[")[0]


def file_of(nodeid: str) -> str:
    return nodeid.partition("::")[0]


def path_of(nodeid: str) -> str:
    """The table's path for a test (its file's; any other file under tests/e2e: ``e2e``)."""
    known = FILES.get(file_of(nodeid))
    if known is not None:
        return known.path
    return E2E_PATH if file_of(nodeid).startswith(("tests/e2e/", "tests/faults/")) else "other"


def property_of(nodeid: str, recorded: str = "") -> str:
    """The property a test judges: the one its ``expect`` recorded, its own, or its file's default;
    an e2e test without one: its function name."""
    if recorded:
        return recorded
    name = function_name(nodeid)
    if name in OWN_PROPERTY:
        return OWN_PROPERTY[name]
    known = FILES.get(file_of(nodeid))
    return known.property if known is not None else name.removeprefix("test_")


def nodeid_from_junit(classname: str, name: str, root: Path = REPO_ROOT) -> str:
    """A junit ``testcase``'s pytest node id (``classname`` is the module's dotted path, then any class)."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        module = "/".join(parts[:cut]) + ".py"
        if module in FILES or (root / module).is_file():
            return "::".join([module, *parts[cut:], name])
    return "::".join(["/".join(parts) + ".py", name])

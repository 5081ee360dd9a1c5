"""Detaching read-only (channel-backed) arrays from real vLLM ``ModelRunnerOutput`` objects."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_zerocopy_testbed import vllm_source
from vllm_zerocopy_testbed.config import PatchMode
from vllm_zerocopy_testbed.harness.ray_channel import OutputShape, make_output
from vllm_zerocopy_testbed.patches import detach

pytestmark = pytest.mark.unit


def _skip_where_vllm_has_no_detach(mode: PatchMode) -> None:
    """Mode ``upstream`` runs vLLM's own detach: a vLLM without one (it went with the compiled-graph executor)
    has nothing to judge here, which ``make check`` reports as the path gone, not as a failure."""
    if mode is PatchMode.UPSTREAM and "Ray output detach" in vllm_source.running()["lacks"]:
        pytest.skip("the vLLM under test has no Ray output detach (it went with the compiled-graph executor)")


def _freeze(array: np.ndarray) -> np.ndarray:
    """Return a read-only view over immutable bytes, as Ray's channel gives them."""
    return np.frombuffer(array.tobytes(), dtype=array.dtype).reshape(array.shape)


def _channel_output():
    from vllm.v1.outputs import LogprobsLists, SamplingMaskLists

    out = make_output(0, OutputShape(sampling_mask=True))
    out.logprobs = LogprobsLists(*(_freeze(a) for a in out.logprobs[:3]), out.logprobs[3])
    masks = out.sampling_masks
    out.sampling_masks = SamplingMaskLists(_freeze(masks.token_ids), _freeze(masks.offsets))
    return out


def _read_only(*arrays: np.ndarray) -> list[bool]:
    return [not a.flags.writeable for a in arrays]


def test_every_read_only_array_is_copied_with_values_and_types_kept(detach_mode, expect) -> None:
    _skip_where_vllm_has_no_detach(detach_mode)
    expect("detach_logprobs", detach_mode)
    out = _channel_output()
    before = [a.copy() for a in out.logprobs[:3]]
    detach.resolve(detach_mode)(out)
    assert type(out.logprobs).__name__ == "LogprobsLists"
    assert not any(_read_only(*out.logprobs[:3])), "logprobs still backed by the channel"
    for old, new in zip(before, out.logprobs[:3]):
        assert np.array_equal(old, new) and old.dtype == new.dtype


@pytest.mark.parametrize("frozen", [0, 1, 2], ids=["token_ids", "logprobs", "ranks"])
def test_a_read_only_array_is_copied_and_the_writable_ones_are_kept_as_they_are(frozen, detach_mode, expect) -> None:
    """One array of the logprobs read-only beside writable ones: that one is copied (each array is judged on its
    own), and the writable ones stay the very objects they were (copying them costs a step for nothing)."""
    from vllm.v1.outputs import LogprobsLists

    _skip_where_vllm_has_no_detach(detach_mode)
    expect("detach_logprobs", detach_mode)
    out = make_output(0, OutputShape())
    arrays = [np.array(a) for a in out.logprobs[:3]]
    arrays[frozen] = _freeze(arrays[frozen])
    out.logprobs = LogprobsLists(*arrays, out.logprobs[3])
    detach.resolve(detach_mode)(out)
    assert not any(_read_only(*out.logprobs[:3])), f"{LogprobsLists._fields[frozen]} still backed by the channel"
    assert np.array_equal(out.logprobs[frozen], arrays[frozen])
    kept = [out.logprobs[i] is arrays[i] for i in range(3) if i != frozen]
    assert all(kept), f"writable arrays were replaced: {[LogprobsLists._fields[i] for i in range(3) if i != frozen]}"


def test_sampling_masks_are_detached(detach_mode, expect) -> None:
    _skip_where_vllm_has_no_detach(detach_mode)
    expect("detach_sampling_mask", detach_mode)
    out = _channel_output()
    detach.resolve(detach_mode)(out)
    assert type(out.sampling_masks).__name__ == "SamplingMaskLists"
    assert not any(_read_only(out.sampling_masks.token_ids, out.sampling_masks.offsets)), \
        "sampling masks still backed by the channel"


def test_auxiliary_rows_are_detached(detach_mode, expect) -> None:
    """``aux_output_connector_output`` (routed experts): one read-only ``rows`` array per request."""
    _skip_where_vllm_has_no_detach(detach_mode)
    from vllm.distributed.aux_output_connector.connector import AuxRequestOutput

    expect("detach_logprobs", detach_mode)
    out = make_output(0, OutputShape())
    out.aux_output_connector_output = {f"req-{i}": AuxRequestOutput(i, _freeze(np.arange(6, dtype=np.int32) + i))
                                       for i in range(4)}
    detach.resolve(detach_mode)(out)
    rows = [aux.rows for aux in out.aux_output_connector_output.values()]
    assert not any(_read_only(*rows)), "auxiliary rows still backed by the channel"
    assert all(np.array_equal(r, np.arange(6) + i) for i, r in enumerate(rows))


def test_writable_arrays_are_left_alone() -> None:
    out = make_output(1, OutputShape(prompt_len=3))
    arrays = list(out.logprobs[:3])
    detach.detach_output(out)
    assert all(new is old for new, old in zip(out.logprobs[:3], arrays))


def test_nested_containers_and_none_are_handled() -> None:
    frozen = _freeze(np.arange(6, dtype=np.int64))
    tree = {"a": [frozen, (frozen, {"b": frozen})]}
    detach._detached(tree, set())
    assert tree["a"][0].flags.writeable
    assert tree["a"][1][0].flags.writeable and tree["a"][1][1]["b"].flags.writeable
    detach.detach_output(None)


def test_the_fast_paths_for_atom_containers_still_find_arrays() -> None:
    """Lists and dicts of plain values are skipped in one pass; one array among them is still found."""
    frozen = _freeze(np.arange(4, dtype=np.int32))
    rows = [[1], [2], [3, frozen]]  # a list of lists, as sampled_token_ids, one row holding an array
    ids = {"req-0": 0, "req-1": frozen}
    flat = ["req-0", 7, None, frozen]
    detach._detached({"rows": rows, "ids": ids, "flat": flat}, set())
    assert rows[2][1].flags.writeable and ids["req-1"].flags.writeable and flat[3].flags.writeable
    assert rows[:2] == [[1], [2]] and ids["req-0"] == 0 and flat[:3] == ["req-0", 7, None]


@pytest.mark.needs_vllm("compiled-graph executor")  # where vLLM calls the detach
def test_apply_replaces_the_function_vllm_calls(detach_mode) -> None:
    from vllm.v1.executor import ray_executor, ray_utils

    try:
        detach.apply(detach_mode)
        assert detach.active_mode() is detach_mode
        assert ray_executor.detach_zero_copy_from_model_runner_output is detach.resolve(detach_mode)
    finally:
        detach.apply(PatchMode.UPSTREAM)
    for module in (ray_executor, ray_utils):  # vLLM's own function is back where vLLM calls it
        restored = module.detach_zero_copy_from_model_runner_output
        assert (restored.__module__, restored.__name__) == (
            "vllm.v1.executor.ray_utils", "detach_zero_copy_from_model_runner_output"), module.__name__


def test_one_execution_in_flight_only_for_compiled_graphs_with_pp_and_tp(monkeypatch) -> None:
    from types import SimpleNamespace

    from vllm_zerocopy_testbed.patches import inflight

    def config(pp: int, tp: int, backend: str = "ray") -> SimpleNamespace:
        return SimpleNamespace(parallel_config=SimpleNamespace(
            distributed_executor_backend=backend, pipeline_parallel_size=pp, tensor_parallel_size=tp))

    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")
    assert inflight.needed(config(2, 2))
    assert not inflight.needed(config(2, 1)) and not inflight.needed(config(1, 2))
    assert not inflight.needed(config(2, 2, backend="mp"))
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "1")
    assert not inflight.needed(config(2, 2)), "the V2 executor keeps its pipelining"


def test_a_frozen_dataclass_holding_a_channel_array_is_rebuilt_not_changed_in_place() -> None:
    """A field vLLM adds may be a frozen dataclass: ours replaces it with a detached copy."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Rows:
        rows: np.ndarray
        label: str

    out = make_output(0, OutputShape())
    out.aux_output_connector_output = {"req-0": Rows(_freeze(np.arange(8, dtype=np.int64)), "aux")}  # object
    detach.detach_output(out)
    rows = out.aux_output_connector_output["req-0"]
    assert type(rows) is Rows and rows.label == "aux"
    assert rows.rows.flags.writeable and np.array_equal(rows.rows, np.arange(8))


def test_types_that_cannot_hold_a_channel_array_are_skipped_whole() -> None:
    """Worked out once per type from annotations: lists of strings, index dicts and torch tensors
    (Ray copies them) cost nothing per step; arrays, ``object`` and the output itself are walked."""
    import torch
    from vllm.v1.outputs import LogprobsTensors, ModelRunnerOutput

    for declared in (list[str], dict[str, int], list[list[int]], torch.Tensor, set[str],
                     dict[str, LogprobsTensors | None], list[torch.Tensor | None] | None):
        assert detach.plan_for(declared) is None, declared
    assert detach.plan_for(np.ndarray) is detach._array
    assert detach.plan_for(object) is detach._by_runtime_type
    assert detach.plan_for(ModelRunnerOutput) is not None


def test_auxiliary_outputs_of_mixed_types_are_all_detached() -> None:
    """The first item picks the generated loop for its type; items of other types still get theirs."""
    import dataclasses

    from vllm.distributed.aux_output_connector.connector import AuxRequestOutput
    from vllm.v1.outputs import SamplingMaskLists

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        rows: np.ndarray

    out = make_output(0, OutputShape())
    out.aux_output_connector_output = {
        "a": AuxRequestOutput(0, _freeze(np.arange(3))), "b": Frozen(_freeze(np.arange(4))),
        "c": SamplingMaskLists(_freeze(np.arange(5))), "d": [_freeze(np.arange(6))],
        "e": AuxRequestOutput(1, _freeze(np.arange(7)))}
    detach.detach_output(out)
    aux = out.aux_output_connector_output
    arrays = [aux["a"].rows, aux["b"].rows, aux["c"].token_ids, aux["d"][0], aux["e"].rows]
    assert not any(_read_only(*arrays)), [a.flags.writeable for a in arrays]
    assert type(aux["b"]) is Frozen and type(aux["c"]) is SamplingMaskLists
    assert [len(a) for a in arrays] == [3, 4, 5, 6, 7]


def test_the_inflight_mode_switches_both_ways_on_a_real_vllm_config(monkeypatch) -> None:
    """``testbed`` caps a compiled-graph PP=2 x TP=2 config at one execution; switching back to
    ``upstream`` gives vLLM's own value again (the wrapper stays, the cap does not)."""
    from vllm.config import ParallelConfig, VllmConfig

    from vllm_zerocopy_testbed.patches import inflight

    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")
    config = VllmConfig(parallel_config=ParallelConfig(pipeline_parallel_size=2, tensor_parallel_size=2,
                                                       distributed_executor_backend="ray"))
    try:
        inflight.apply(PatchMode.TESTBED)
        assert (config.max_concurrent_batches, inflight.active_mode()) == (1, PatchMode.TESTBED)
        inflight.apply(PatchMode.UPSTREAM)
        assert (config.max_concurrent_batches, inflight.active_mode()) == (2, PatchMode.UPSTREAM)
    finally:
        inflight.apply(PatchMode.UPSTREAM)

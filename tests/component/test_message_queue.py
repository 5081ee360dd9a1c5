"""vLLM's MessageQueue across processes: bit-exact, writable, zero-copy, and free of the send race."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from vllm_zerocopy_testbed.harness.message_queue import MessageQueueHarness, QueueTopology, describe
from vllm_zerocopy_testbed.patches.broadcast import OOB_MIN_BYTES

pytestmark = [pytest.mark.component, pytest.mark.timeout(180)]

MiB = 1 << 20

TOPOLOGIES = {
    "ring-2-local": QueueTopology(local_readers=2),
    "overflow-local": QueueTopology(local_readers=1, max_chunk_bytes=2 * MiB),
    "remote-tcp": QueueTopology(local_readers=0, remote_readers=1),
    "local+remote": QueueTopology(local_readers=1, remote_readers=1, max_chunk_bytes=8 * MiB),
}


def _payloads() -> list[dict]:
    gen = torch.Generator().manual_seed(7)
    return [
        {"below": torch.randn(OOB_MIN_BYTES // 4 - 64, generator=gen)},
        {"at": torch.randn(OOB_MIN_BYTES // 4, generator=gen)},
        {"above_bf16": torch.randn(3 * MiB, generator=gen).to(torch.bfloat16),
         "ids": torch.arange(4096, dtype=torch.int64),
         "embeds_fp16": torch.randn(1500, 1024, generator=gen).half()},
        {"mask": torch.rand(MiB + 7, generator=gen) > 0.5,
         "complex": torch.randn(MiB // 4, dtype=torch.complex64, generator=gen),
         "array": np.arange(MiB, dtype=np.float32)},
        {"big": torch.randn(4 * MiB, generator=gen)},  # 16 MiB: overflows small rings
    ]


@pytest.mark.parametrize("topology", TOPOLOGIES.values(), ids=TOPOLOGIES.keys())
def test_every_reader_gets_bit_exact_writable_tensors(topology: QueueTopology, broadcast_mode) -> None:
    with MessageQueueHarness(topology, broadcast_mode) as harness:
        for payload in _payloads():
            expected = describe(payload)
            reports = harness.broadcast(payload)
            assert sorted(reports) == list(range(1, topology.readers + 1))
            for rank, report in reports.items():
                assert report == expected, f"reader {rank} got different bytes or lost writability"


def test_fp8_tensors_cross_the_queue(broadcast_mode, expect) -> None:
    expect("fp8_transport", broadcast_mode)
    payload = {
        "small": torch.linspace(-4, 4, 64).to(torch.float8_e4m3fn),
        "large": torch.linspace(-4, 4, 2 * MiB).to(torch.float8_e5m2),
    }
    with MessageQueueHarness(TOPOLOGIES["local+remote"], broadcast_mode, timeout=20) as harness:
        reports = harness.broadcast(payload)
    assert all(report == describe(payload) for report in reports.values()), f"readers got {reports}"


def test_tensors_above_the_limit_travel_out_of_band(broadcast_mode, expect) -> None:
    """The remote reader counts the frames on the wire: the tensor must be its own frame."""
    expect("zero_copy", broadcast_mode)
    tensor = torch.randn(2 * MiB)
    with MessageQueueHarness(QueueTopology(local_readers=0, remote_readers=1), broadcast_mode,
                             wire_report=True) as harness:
        frames = harness.broadcast({"embeds": tensor})[1]["frames"]
    assert tensor.numel() * 4 in frames, f"no frame carries the tensor's bytes: {frames}"
    assert frames[0] < OOB_MIN_BYTES, "the pickle stream still holds the tensor"


RACE_PATHS = {
    "remote-tcp": QueueTopology(local_readers=0, remote_readers=1),
    "overflow-local": QueueTopology(local_readers=1, max_chunk_bytes=MiB),
    # vLLM 0.32's tensor arena takes tensors >= 8 MiB; what it leaves overflows to ZMQ as before
    "arena-overflow-local": QueueTopology(local_readers=1, max_chunk_bytes=MiB, arena=True),
}


@pytest.mark.parametrize("kind", ["tensor", "ndarray"])
@pytest.mark.parametrize("path", [pytest.param(topology, id=name, marks=[pytest.mark.needs_vllm("tensor arena")]
                                               if topology.arena else [])
                                  for name, topology in RACE_PATHS.items()])
def test_mutating_after_enqueue_never_reaches_readers(path, kind, broadcast_mode, expect) -> None:
    """Upstream PR 53217, deterministic: readers are stopped while the writer reuses its buffer.

    A stopped reader's ZMQ thread drains nothing, so the bytes a racy enqueue
    left to ZMQ are still in the writer's memory when the writer overwrites it.
    A timer resumes the readers after 3 s so that an enqueue that waits for ZMQ
    can finish; the check is on bytes, not on time. On an arena queue the tensor is
    4 MiB, under the arena's 8 MiB (a larger one is copied into a slot: no race).
    """
    expect(f"race_free_{kind}", broadcast_mode)
    # 32 MiB (4 MiB on an arena queue), far above socket buffers
    original = torch.arange((MiB if path.arena else 8 * MiB), dtype=torch.float32)
    value = original.clone() if kind == "tensor" else original.numpy().copy()
    expected = describe({"x": value})
    with MessageQueueHarness(path, broadcast_mode) as harness:
        harness.pause_readers()
        resume = threading.Timer(3.0, harness.resume_readers)
        resume.start()
        try:
            harness.send({"x": value})
            value[:] = -1  # the caller reuses its buffer once enqueue returned
        finally:
            resume.cancel()
            harness.resume_readers()
        reports = harness.collect()
    for rank, report in reports.items():
        assert report["x"].digest == expected["x"].digest, f"reader {rank} saw bytes written after enqueue"


@pytest.mark.parametrize("topology", TOPOLOGIES.values(), ids=TOPOLOGIES.keys())
def test_tensors_torch_reduces_itself_and_empty_ones_arrive_as_sent(topology: QueueTopology, broadcast_mode) -> None:
    """A tensor that requires grad keeps it, below and above 1 MiB: vLLM leaves it to torch's own
    reduction, where the out-of-band view of its bytes would arrive without it. An empty tensor has no
    bytes to rebuild from and arrives with its shape and dtype. Both were never sent before, and
    mechanical mutants of the reducer's condition and the rebuild's empty branch survived."""
    payload = {"grad": torch.linspace(-1, 1, 64).requires_grad_(),
               "grad_above": torch.linspace(-1, 1, MiB // 4 + 16).requires_grad_(),
               "empty": torch.empty(0, 4), "empty_bf16": torch.empty(3, 0, dtype=torch.bfloat16)}
    with MessageQueueHarness(topology, broadcast_mode, timeout=20) as harness:
        reports = harness.broadcast(payload)
    expected = describe(payload)
    for rank, report in reports.items():
        assert report == expected, f"reader {rank} got {report}"

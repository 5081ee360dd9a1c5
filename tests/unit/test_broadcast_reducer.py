"""Our tensor reducer and rebuilder, through real pickling with out-of-band buffers."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from vllm_zerocopy_testbed.harness.message_queue import describe_item
from vllm_zerocopy_testbed.patches.broadcast import OOB_MIN_BYTES, rebuild_tensor, serialize

pytestmark = pytest.mark.unit

DTYPES = [
    torch.float32, torch.float64, torch.bfloat16, torch.float16,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.bool, torch.complex64, torch.complex128,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
]


def _tensor(dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """Return a tensor of about ``nbytes`` whose every byte pattern is defined."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (max(1, nbytes // itemsize) * itemsize,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(nbytes))
    if dtype.is_floating_point or dtype.is_complex:
        raw = raw & 0x3F  # keep exponents small: no NaN payloads to compare
    return raw.view(dtype) if dtype is not torch.bool else raw.bool()


def _roundtrip(obj):
    frames = serialize(obj, zero_copy_tensors=True)
    return pickle.loads(frames[0], buffers=frames[1:]), len(frames) - 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nbytes", [64, OOB_MIN_BYTES - 8, OOB_MIN_BYTES, 3 * OOB_MIN_BYTES + 8])
def test_roundtrip_is_bit_exact_for_every_dtype(dtype: torch.dtype, nbytes: int) -> None:
    tensor = _tensor(dtype, nbytes)
    back, out_of_band = _roundtrip({"t": tensor})
    assert describe_item(back["t"]) == describe_item(tensor)
    expected_oob = int(tensor.numel() * tensor.element_size() >= OOB_MIN_BYTES)
    assert out_of_band == expected_oob, "tensors of at least OOB_MIN_BYTES go out of band"


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.tensor(3.5), id="0-dim"),
        pytest.param(lambda: torch.empty(0, 128), id="empty"),
        pytest.param(lambda: torch.arange(2 << 20, dtype=torch.float32).reshape(1024, -1).t(), id="non-contiguous"),
        pytest.param(lambda: torch.arange(2 << 20, dtype=torch.float32)[::2], id="strided-slice"),
        pytest.param(lambda: torch.randn(1 << 18, dtype=torch.complex64).conj(), id="conj"),
        pytest.param(lambda: torch.nn.Parameter(torch.randn(1 << 18)), id="parameter"),
        pytest.param(lambda: torch.randn(1 << 18, requires_grad=True), id="requires-grad"),
    ],
)
def test_roundtrip_keeps_special_tensors(make) -> None:
    tensor = make()
    back, _ = _roundtrip([tensor])
    assert describe_item(back[0]) == describe_item(tensor)
    assert type(back[0]) is type(tensor)


def _upstream_rebuild():
    from vllm.distributed.device_communicators import shm_broadcast

    return shm_broadcast._rebuild_tensor


@pytest.mark.parametrize("rebuild", [_upstream_rebuild, lambda: rebuild_tensor], ids=["upstream", "testbed"])
def test_rebuilt_tensor_is_writable_and_aliases_only_writable_buffers(rebuild) -> None:
    """A local reader's dequeue already copied the buffer out of the shared-memory ring into a bytearray
    of its own: the tensor must be a view of it (a second copy doubles the reader's cost per message);
    immutable bytes are copied, so a write never lands in them."""
    data = np.arange(1 << 18, dtype=np.float32)
    writable = bytearray(data.tobytes())
    aliased = rebuild()(writable, (1 << 18,), "float32")
    assert aliased.data_ptr() == np.frombuffer(writable, np.uint8).ctypes.data, "the bytearray was copied"
    frozen = bytes(writable)
    copied = rebuild()(frozen, (1 << 18,), "float32")
    assert copied.data_ptr() != np.frombuffer(frozen, np.uint8).ctypes.data, "bytes are copied"
    copied[0] = 42.0  # a write must never land in an immutable bytes object
    assert frozen[:4] == data[:1].tobytes()
    assert torch.equal(aliased, copied.index_fill(0, torch.tensor([0]), 0.0))


def test_small_tensors_stay_in_band() -> None:
    small = torch.ones(16)
    frames = serialize({"small": small, "text": "x", "n": 3}, zero_copy_tensors=True)
    assert len(frames) == 1
    assert pickle.loads(frames[0])["small"].equal(small)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_torch_reduction_cannot_load_fp8_which_is_why_small_tensors_skip_it(dtype) -> None:
    """Guards the design choice in ``reduce_tensor``: if torch fixes this, revisit it."""
    with pytest.raises(AttributeError, match="dtype"):
        pickle.loads(pickle.dumps(torch.zeros(4, dtype=dtype), protocol=pickle.HIGHEST_PROTOCOL))


def test_off_policy_keeps_tensors_in_the_stream() -> None:
    big = torch.ones(OOB_MIN_BYTES // 4 * 2)
    frames = serialize({"big": big}, zero_copy_tensors=False)
    assert len(frames) == 1 and len(frames[0]) > big.numel() * 4


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rebuild", [_upstream_rebuild, lambda: rebuild_tensor], ids=["upstream", "testbed"])
def test_a_tensor_rebuilt_from_a_received_zmq_frame_aliases_it(rebuild) -> None:
    """Remote readers get frames that own their message: the rebuilt tensor must be a view of it
    (zero copy at the reader), not a copy, and writable."""
    import zmq

    data = np.arange(OOB_MIN_BYTES // 4, dtype=np.float32)
    ctx = zmq.Context()
    try:
        send, recv = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        send.bind("inproc://testbed-frame")
        recv.connect("inproc://testbed-frame")
        send.send(data, copy=False)
        assert recv.poll(5000), "no frame within 5 s"
        frame = recv.recv(copy=False)
        tensor = rebuild()(frame, (data.size,), "float32")
        assert tensor.data_ptr() == np.frombuffer(frame, np.uint8).ctypes.data, "the frame was copied"
        tensor[0] = 42.0
        assert torch.equal(tensor[1:], torch.from_numpy(data[1:]))
    finally:
        ctx.destroy(linger=0)  # closes both sockets, also when an assertion failed

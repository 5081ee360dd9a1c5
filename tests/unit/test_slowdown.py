"""The injected broadcast stall (``TESTBED_FAULT_BROADCAST=stall:S``) that shows the latency checker red."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from vllm_zerocopy_testbed.config import BroadcastFault
from vllm_zerocopy_testbed.patches import slowdown

pytestmark = pytest.mark.unit


@dataclass
class _NewRequest:
    prompt_embeds: torch.Tensor | None


@dataclass
class _Output:
    scheduled_new_reqs: list[_NewRequest] = field(default_factory=list)


def test_a_large_tensor_is_found_inside_a_scheduler_like_message() -> None:
    large = _Output([_NewRequest(None), _NewRequest(torch.zeros(600, 512))])  # 1.17 MiB
    assert slowdown.carries_large_tensor(("execute_model", (large,), {}))
    assert not slowdown.carries_large_tensor(("execute_model", (_Output([_NewRequest(torch.zeros(4, 512))]),), {}))
    assert slowdown.carries_large_tensor({"a": [np.zeros(1 << 20, dtype=np.uint8)]})


def test_the_stall_holds_the_first_large_broadcast_once() -> None:
    stall = slowdown._Stall(BroadcastFault("stall", 0.3))
    start = time.monotonic()
    stall.before_send(("small",))
    assert time.monotonic() - start < 0.1, "no large tensor: no stall"
    stall.before_send({"t": torch.zeros(1 << 18)})
    stall.before_send({"t": torch.zeros(1 << 18)})
    assert 0.3 <= time.monotonic() - start < 0.55, "one stall, once"

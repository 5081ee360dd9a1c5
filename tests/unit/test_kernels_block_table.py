"""The torch block-table and staged-write kernels against loop references written from their Triton
sources (``vllm/v1/worker/gpu/block_table.py``, ``buffer_utils.py``, 0.34.0): no vLLM needed.
Their tables are reached through pointer tables, as vLLM passes them."""

from __future__ import annotations

import pytest
import torch

from vllm_zerocopy_testbed.kernels import block_table as k
from vllm_zerocopy_testbed.kernels.buffer_utils import apply_write

pytestmark = pytest.mark.unit
PAD = -1


def _ptrs(tables: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tables], dtype=torch.uint64)


@pytest.mark.parametrize("mask_window", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_gather_block_tables_matches_loop(seed: int, mask_window: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    max_reqs, widths, sizes, reach = 6, [10, 4], [16, 32], [0, 40]
    src = [torch.randint(1, 100, (max_reqs, w), generator=gen, dtype=torch.int32) for w in widths]
    dst = [torch.full((max_reqs, w), 9, dtype=torch.int32) for w in widths]
    num_blocks = torch.stack([torch.randint(0, w + 1, (max_reqs,), generator=gen, dtype=torch.int32) for w in widths])
    computed = torch.randint(0, 200, (max_reqs,), generator=gen, dtype=torch.int32)
    num_reqs, num_rows = 3, 5
    idx = torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32)
    want = [d.clone() for d in dst]
    for g in range(2):
        for b in range(num_rows):
            if b >= num_reqs:
                want[g][b, :] = 0
                continue
            req = int(idx[b])
            nulls = max(int(computed[req]) - reach[g], 0) // sizes[g] if mask_window and reach[g] > 0 else 0
            for i in range(int(num_blocks[g, req])):
                want[g][b, i] = 0 if i < nulls else src[g][req, i]
    k.gather_block_tables[(2, num_rows)](idx, _ptrs(src), _ptrs(dst), torch.tensor(widths), num_blocks,
                                         num_blocks.stride(0), num_reqs, computed,
                                         torch.tensor(reach, dtype=torch.int32),
                                         torch.tensor(sizes, dtype=torch.int32), MASK_SLIDING_WINDOW=mask_window,
                                         BLOCK_SIZE=1024)
    for got, expected in zip(dst, want):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("seed", range(4))
def test_compute_slot_mappings_matches_loop(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    max_reqs, widths, sizes, enabled = 6, [8, 8], [16, 4], [True, False]
    tables = [torch.randint(0, 50, (max_reqs, w), generator=gen, dtype=torch.int32) for w in widths]
    num_reqs, max_tokens = 3, 24
    idx = torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32)
    idx[1] = -1  # a dummy request
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.randint(0, 6, (num_reqs,), generator=gen), 0)
    pos = torch.randint(0, 30, (max_tokens,), generator=gen, dtype=torch.int64)
    out = torch.full((2, max_tokens), 77, dtype=torch.int64)
    want = out.clone()
    for g in range(2):
        for b in range(num_reqs):
            req = int(idx[b])
            for t in range(int(qsl[b]), int(qsl[b + 1])):
                p = int(pos[t])
                ok = enabled[g] and req >= 0
                want[g, t] = int(tables[g][req, p // sizes[g]]) * sizes[g] + p % sizes[g] if ok else PAD
        for t in range(int(qsl[num_reqs]), max_tokens):
            want[g, t] = PAD
    k.compute_slot_mappings[(2, num_reqs + 1)](max_tokens, idx, qsl, pos, _ptrs(tables), torch.tensor(widths),
                                               torch.tensor(sizes, dtype=torch.int32), torch.tensor(enabled),
                                               torch.tensor([True, True]), out, out.stride(0), 0, CP_SIZE=1,
                                               CP_INTERLEAVE=1, PAD_ID=PAD, TRITON_BLOCK_SIZE=1024)
    assert torch.equal(out, want)


def _writes(gen: torch.Generator, rows: int, width: int, n: int):
    indices = torch.randint(0, rows, (n,), generator=gen, dtype=torch.int32)
    lens = torch.randint(0, 4, (n,), generator=gen)
    starts = torch.stack([torch.randint(0, width - int(l) + 1, (1,), generator=gen)[0] for l in lens]).to(torch.int32)
    cu = torch.cumsum(lens, 0).to(torch.int32)
    contents = torch.randint(0, 1000, (int(cu[-1]) if n else 0,), generator=gen, dtype=torch.int32)
    return indices, starts, cu, contents


@pytest.mark.parametrize("seed", range(4))
def test_apply_write_matches_loop(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    out = torch.zeros(5, 7, dtype=torch.int32)
    indices, starts, cu, contents = _writes(gen, 5, 7, 6)
    want = out.clone()
    prev = 0
    for i in range(6):
        for j in range(int(cu[i]) - prev):
            want[indices[i], starts[i] + j] = contents[prev + j]
        prev = int(cu[i])
    apply_write[(6, 1)](out, out.stride(0), indices, starts, contents, cu, None, BLOCK_SIZE=1024, MULTI_GROUP=False)
    assert torch.equal(out, want)


def test_apply_write_multi_group_matches_loop() -> None:
    gen = torch.Generator().manual_seed(1)
    outs = [torch.zeros(5, 7, dtype=torch.int32), torch.zeros(5, 9, dtype=torch.int32)]
    indices, starts, cu, contents = _writes(gen, 5, 7, 8)
    groups = torch.randint(0, 2, (8,), generator=gen, dtype=torch.int32)
    want = [o.clone() for o in outs]
    prev = 0
    for i in range(8):
        for j in range(int(cu[i]) - prev):
            want[int(groups[i])][indices[i], starts[i] + j] = contents[prev + j]
        prev = int(cu[i])
    apply_write[(8, 1)](_ptrs(outs), torch.tensor([7, 9]), indices, starts, contents, cu, groups, BLOCK_SIZE=1024,
                        MULTI_GROUP=True)
    for got, expected in zip(outs, want):
        assert torch.equal(got, expected)

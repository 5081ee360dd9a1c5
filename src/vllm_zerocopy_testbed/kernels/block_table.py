"""Block tables and slot mappings (``vllm/v1/worker/gpu/block_table.py``): the per-group tables are
reached through pointer tables (one int32 table's address per KV-cache group)."""

from __future__ import annotations

import torch

from vllm_zerocopy_testbed.kernels._launch import Grid, at_address, grid_kernel

_MODULE = "vllm.v1.worker.gpu.block_table"


def _row(ptrs: torch.Tensor, group: int, row: int, stride: int) -> torch.Tensor:
    """Row ``row`` (``stride`` int32 entries) of the table whose address is ``ptrs[group]``."""
    base = int(ptrs.view(torch.int64)[group])
    return at_address(base + 4 * row * stride, torch.int32, stride)


@grid_kernel
def gather_block_tables(grid: Grid, batch_idx_to_req_idx, src_block_table_ptrs, dst_block_table_ptrs,
                        block_table_strides, num_blocks_ptr, num_blocks_stride, num_reqs, num_computed_tokens_ptr,
                        sliding_window_reach_ptr, block_sizes_ptr, MASK_SLIDING_WINDOW: bool = False,
                        BLOCK_SIZE: int = 1024, **launch) -> None:
    """For each group and batch row < ``num_reqs``: the request's first ``num_blocks`` block ids
    (those wholly below a sliding window's reach as 0); rows past ``num_reqs`` up to the grid, zeros."""
    num_groups, num_rows = grid[0], grid[1]
    reqs = batch_idx_to_req_idx[:num_reqs].tolist()
    for group in range(num_groups):
        stride = int(block_table_strides[group])
        counts = num_blocks_ptr.reshape(-1)[group * num_blocks_stride:(group + 1) * num_blocks_stride]
        for batch_idx in range(num_rows):
            dst = _row(dst_block_table_ptrs, group, batch_idx, stride)
            if batch_idx >= num_reqs:
                dst.zero_()
                continue
            req = reqs[batch_idx]
            n = int(counts[req])
            src = _row(src_block_table_ptrs, group, req, stride)
            num_null = 0
            if MASK_SLIDING_WINDOW:
                reach = int(sliding_window_reach_ptr[group])
                if reach > 0:
                    num_null = max(int(num_computed_tokens_ptr[req]) - reach, 0) // int(block_sizes_ptr[group])
            dst[:n] = src[:n]
            dst[:min(num_null, n)] = 0


@grid_kernel
def compute_slot_mappings(grid: Grid, max_num_tokens, idx_mapping, query_start_loc, pos, block_table_ptrs,
                          block_table_strides, block_sizes, slot_mapping_enabled, dcp_sharded, slot_mappings_ptr,
                          slot_mappings_stride, cp_rank, CP_SIZE: int = 1, CP_INTERLEAVE: int = 1, PAD_ID: int = -1,
                          TRITON_BLOCK_SIZE: int = 1024, **launch) -> None:
    """Each token's KV slot ``block_table[req][pos // block_size] * block_size + pos % block_size``
    per group (``PAD_ID`` for dummy requests, disabled groups, and from the batch's last token to
    ``max_num_tokens``)."""
    if CP_SIZE != 1:
        raise NotImplementedError("slot mappings under context parallelism (decode_context_parallel_size > 1)")
    num_groups, num_reqs = grid[0], grid[1] - 1
    qsl = query_start_loc[:num_reqs + 1].tolist()
    reqs = idx_mapping[:num_reqs].tolist()
    out = slot_mappings_ptr.reshape(-1)
    for group in range(num_groups):
        row = out[group * slot_mappings_stride:group * slot_mappings_stride + max_num_tokens]
        row[qsl[num_reqs]:max_num_tokens] = PAD_ID
        stride = int(block_table_strides[group])
        block_size = int(block_sizes[group])
        enabled = bool(slot_mapping_enabled[group])
        for batch_idx, req in enumerate(reqs):
            start, end = qsl[batch_idx], qsl[batch_idx + 1]
            if end <= start:
                continue
            if not enabled or req < 0:
                row[start:end] = PAD_ID
                continue
            positions = pos[start:end].long()
            table = _row(block_table_ptrs, group, req, stride).long()
            row[start:end] = (table[positions // block_size] * block_size + positions % block_size).to(row.dtype)


OVERRIDES = {
    f"{_MODULE}._gather_block_tables_kernel": gather_block_tables,
    f"{_MODULE}._compute_slot_mappings_kernel": compute_slot_mappings,
}

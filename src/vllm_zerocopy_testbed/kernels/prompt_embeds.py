"""Prompt embeddings overlaid onto the input embeddings
(``vllm/v1/worker/gpu/model_states/prompt_embeds.py``): ``_apply_prompt_embeds_kernel``."""

from __future__ import annotations

import torch

from vllm_zerocopy_testbed.kernels._launch import Grid, at_address, grid_kernel

_MODULE = "vllm.v1.worker.gpu.model_states.prompt_embeds"


@grid_kernel
def apply_prompt_embeds(grid: Grid, inputs_embeds_ptr, inputs_embeds_stride, embeds_ptrs_ptr, mask_ptrs_ptr,
                        embeds_lens_ptr, idx_mapping_ptr, query_start_loc_ptr, num_computed_tokens_ptr, hidden_size,
                        TOKEN_BLOCK: int = 16, BLOCK_SIZE: int = 1024, **launch) -> None:
    """Per request with prompt embeddings left: its next rows (from ``num_computed``, as many as its
    query has) over its query's rows of ``inputs_embeds``, except rows its is-token-id mask marks.
    The embeddings and mask are reached through their addresses (``embeds_ptrs``, ``mask_ptrs``)."""
    qsl = query_start_loc_ptr.tolist()
    embeds_addrs = embeds_ptrs_ptr.view(torch.int64)
    mask_addrs = mask_ptrs_ptr.view(torch.int64)
    for batch_idx, req in enumerate(idx_mapping_ptr[:grid[0]].tolist()):
        embeds_len = int(embeds_lens_ptr[req])
        done = int(num_computed_tokens_ptr[req])
        if done >= embeds_len:
            continue
        start, end = qsl[batch_idx], qsl[batch_idx + 1]
        num_rows = min(end - start, embeds_len - done)
        if num_rows <= 0:
            continue
        src = at_address(int(embeds_addrs[req]), inputs_embeds_ptr.dtype, embeds_len * hidden_size)
        rows = src.view(embeds_len, hidden_size)[done:done + num_rows]
        keep = torch.ones(num_rows, dtype=torch.bool)
        mask_addr = int(mask_addrs[req])
        if mask_addr != 0:
            keep = at_address(mask_addr, torch.int8, embeds_len)[done:done + num_rows] == 0
        dst = inputs_embeds_ptr[start:start + num_rows, :hidden_size]
        dst[keep] = rows[keep]


OVERRIDES = {f"{_MODULE}._apply_prompt_embeds_kernel": apply_prompt_embeds}

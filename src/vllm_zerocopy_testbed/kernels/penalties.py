"""Repetition, frequency and presence penalties (``vllm/v1/worker/gpu/sample/penalties.py``)."""

from __future__ import annotations

import torch

from vllm_zerocopy_testbed.kernels._launch import Grid, grid_kernel
from vllm_zerocopy_testbed.kernels.structured_outputs import unpack_bitmask

_MODULE = "vllm.v1.worker.gpu.sample.penalties"


@grid_kernel
def bincount(grid: Grid, expanded_idx_mapping_ptr, all_token_ids_ptr, all_token_ids_stride, prompt_len_ptr,
             prefill_len_ptr, prompt_bin_mask_ptr, prompt_bin_mask_stride, output_bin_counts_ptr,
             output_bin_counts_stride, BLOCK_SIZE: int = 1024, **launch) -> None:
    """Per request: set bit ``t % 32`` of word ``t // 32`` of its prompt mask for each prompt token
    ``t``, and count each token of its prefill past the prompt (``prompt_len..prefill_len``) in its
    output counts (the caller zeroed both rows)."""
    limit = grid[1] * BLOCK_SIZE  # the launch covers the first num_blocks * BLOCK_SIZE tokens
    for req in expanded_idx_mapping_ptr[:grid[0]].tolist():
        prompt_len = min(int(prompt_len_ptr[req]), limit)
        prefill_len = min(int(prefill_len_ptr[req]), limit)
        row = all_token_ids_ptr[req].long()
        prompt = torch.unique(row[:prompt_len])
        if prompt.numel():
            words = prompt // 32
            bits = torch.ones_like(prompt) << (prompt % 32)
            packed = torch.zeros(prompt_bin_mask_ptr.shape[1], dtype=torch.int64).index_add_(0, words, bits)
            # Distinct tokens set distinct bits: their sum is their OR. Back to int32's range.
            packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed)
            prompt_bin_mask_ptr[req] |= packed.to(prompt_bin_mask_ptr.dtype)
        if prefill_len > prompt_len:
            tokens = row[prompt_len:prefill_len]
            output_bin_counts_ptr[req].index_add_(0, tokens, torch.ones_like(tokens, dtype=output_bin_counts_ptr.dtype))


@grid_kernel
def penalties(grid: Grid, logits_ptr, logits_stride, expanded_idx_mapping_ptr, token_ids_ptr, expanded_local_pos_ptr,
              repetition_penalty_ptr, frequency_penalty_ptr, presence_penalty_ptr, prompt_bin_mask_ptr,
              prompt_bin_mask_stride, output_bin_counts_ptr, output_bin_counts_stride, vocab_size,
              BLOCK_SIZE: int = 8192, **launch) -> None:
    """Per token (in float32): the request's output counts plus the draft tokens before this one
    in its row; the repetition penalty on tokens seen in the prompt or output (divide positive
    logits, multiply the others), then ``freq * count`` and ``pres * seen`` subtracted."""
    for token_idx in range(grid[0]):
        req = int(expanded_idx_mapping_ptr[token_idx])
        rep = float(repetition_penalty_ptr[req])
        freq = float(frequency_penalty_ptr[req])
        pres = float(presence_penalty_ptr[req])
        if rep == 1.0 and freq == 0.0 and pres == 0.0:
            continue
        row = logits_ptr[token_idx, :vocab_size]
        logits = row.to(torch.float32)
        counts = output_bin_counts_ptr[req, :vocab_size].clone()
        pos = int(expanded_local_pos_ptr[token_idx])
        start = token_idx - pos
        for prev in range(pos):
            counts[int(token_ids_ptr[start + prev + 1])] += 1
        seen = counts > 0
        if rep != 1.0:
            in_prompt = unpack_bitmask(prompt_bin_mask_ptr[req:req + 1], vocab_size)[0]
            scale = torch.where(in_prompt | seen, torch.tensor(rep, dtype=torch.float32),
                                torch.tensor(1.0, dtype=torch.float32))
            logits = logits * torch.where(logits > 0, 1.0 / scale, scale)
        logits = logits - torch.tensor(freq, dtype=torch.float32) * counts.to(torch.float32)
        logits = logits - torch.tensor(pres, dtype=torch.float32) * seen.to(torch.float32)
        row.copy_(logits)


OVERRIDES = {
    f"{_MODULE}._bincount_kernel": bincount,
    f"{_MODULE}._penalties_kernel": penalties,
}

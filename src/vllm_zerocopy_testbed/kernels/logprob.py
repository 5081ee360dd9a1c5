"""Logprobs of chosen tokens and ranks (``vllm/v1/worker/gpu/sample/logprob.py``)."""

from __future__ import annotations

import torch

from vllm_zerocopy_testbed.kernels._launch import Grid, grid_kernel

_MODULE = "vllm.v1.worker.gpu.sample.logprob"


@grid_kernel
def topk_log_softmax(grid: Grid, output_ptr, logits_ptr, logits_stride, topk_ids_ptr, topk_ids_stride, topk,
                     vocab_size, BLOCK_SIZE: int = 1024, TOPK_BLOCK_SIZE: int = 1, **launch) -> None:
    """Per row: ``logit[id] - max - log(sum(exp(logits - max)))`` (float32) for its ``topk`` ids,
    into ``output`` read as [rows, topk]."""
    rows = grid[0]
    logits = logits_ptr[:rows, :vocab_size].to(torch.float32)
    max_val = logits.max(dim=1, keepdim=True).values
    lse = torch.log(torch.exp(logits - max_val).sum(dim=1, keepdim=True))
    ids = topk_ids_ptr[:rows, :topk].long()
    out = output_ptr.reshape(-1)[:rows * topk].view(rows, topk)
    out.copy_(logits.gather(1, ids) - max_val - lse)


@grid_kernel
def ranks(grid: Grid, output_ptr, logits_ptr, logits_stride, token_ids_ptr, vocab_size, BLOCK_SIZE: int = 8192,
          **launch) -> None:
    """Per row: how many logits are >= the chosen token's (its rank, 1 for the best)."""
    rows = grid[0]
    logits = logits_ptr[:rows, :vocab_size]
    chosen = logits.gather(1, token_ids_ptr[:rows].long().view(rows, 1))
    output_ptr[:rows] = (logits >= chosen).sum(dim=1).to(output_ptr.dtype)


@grid_kernel
def fill_logprob_token_ids(grid: Grid, out_token_ids_ptr, out_token_ids_stride, out_valid_mask_ptr,
                           out_valid_mask_stride, sampled_token_ids_ptr, topk_indices_ptr, topk_indices_stride,
                           expanded_idx_mapping_ptr, num_per_req_token_ids_ptr, per_req_token_ids_ptr,
                           per_req_token_ids_stride, NUM_TOPK: int = 0, PADDED_COLS: int = 1, **launch) -> None:
    """Per row: column 0 the sampled token, then the request's own logprob token ids where it named
    some, else the top-k ids; the valid mask marks what was written."""
    for batch_idx in range(grid[0]):
        out_token_ids_ptr[batch_idx, 0] = sampled_token_ids_ptr[batch_idx]
        out_valid_mask_ptr[batch_idx, 0] = True
        req = int(expanded_idx_mapping_ptr[batch_idx])
        num_custom = int(num_per_req_token_ids_ptr[req])
        if num_custom > 0:
            n = min(num_custom, PADDED_COLS)
            tokens = per_req_token_ids_ptr[req, :n]
        else:
            n = min(NUM_TOPK, PADDED_COLS)
            tokens = topk_indices_ptr[batch_idx, :n]
        out_token_ids_ptr[batch_idx, 1:1 + n] = tokens.to(out_token_ids_ptr.dtype)
        out_valid_mask_ptr[batch_idx, 1:1 + n] = True


OVERRIDES = {
    f"{_MODULE}._topk_log_softmax_kernel": topk_log_softmax,
    f"{_MODULE}._ranks_kernel": ranks,
    f"{_MODULE}._fill_logprob_token_ids_kernel": fill_logprob_token_ids,
}


@grid_kernel
def prompt_logprobs_token_ids(grid: Grid, prompt_logprobs_token_ids_ptr, query_start_loc_ptr, idx_mapping_ptr,
                              num_computed_tokens_ptr, all_token_ids_ptr, all_token_ids_stride,
                              BLOCK_SIZE: int = 1024, **launch) -> None:
    """Per request: the token after each of its query's positions (``all_token_ids`` from
    ``num_computed + 1``), whose prompt logprob each position gives."""
    qsl = query_start_loc_ptr.tolist()
    for batch_idx, req in enumerate(idx_mapping_ptr[:grid[0]].tolist()):
        start, end = qsl[batch_idx], qsl[batch_idx + 1]
        first = int(num_computed_tokens_ptr[req]) + 1
        row = all_token_ids_ptr[req]
        n = max(0, min(end - start, row.shape[0] - first))  # past the row: never read by the caller
        prompt_logprobs_token_ids_ptr[start:start + n] = row[first:first + n].to(prompt_logprobs_token_ids_ptr.dtype)


OVERRIDES["vllm.v1.worker.gpu.sample.prompt_logprob._prompt_logprobs_token_ids_kernel"] = prompt_logprobs_token_ids

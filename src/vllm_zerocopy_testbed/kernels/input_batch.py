"""Batch preparation and post-step updates (``vllm/v1/worker/gpu/input_batch.py``)."""

from __future__ import annotations

import torch

from vllm_zerocopy_testbed.kernels._launch import Grid, grid_kernel

_MODULE = "vllm.v1.worker.gpu.input_batch"


@grid_kernel
def prepare_prefill_inputs(grid: Grid, input_ids_ptr, next_prefill_tokens_ptr, next_prefill_tokens_stride,
                           num_lookahead, idx_mapping_ptr, query_start_loc_ptr, all_token_ids_ptr,
                           all_token_ids_stride, prefill_lens_ptr, num_computed_tokens_ptr, BLOCK_SIZE: int = 1024,
                           LOOKAHEAD_BLOCK: int = 1, **launch) -> None:
    """For each request still in prefill: copy its prompt tokens from ``num_computed`` on into its
    query's slots of ``input_ids``, and its next ``num_lookahead`` prompt tokens (0 past the prompt)
    into column ``req`` of ``next_prefill_tokens``."""
    qsl = query_start_loc_ptr.tolist()
    for batch_idx, req in enumerate(idx_mapping_ptr[:grid[0]].tolist()):
        prefill_len = int(prefill_lens_ptr[req])
        done = int(num_computed_tokens_ptr[req])
        if done >= prefill_len:
            continue
        start, end = qsl[batch_idx], qsl[batch_idx + 1]
        row = all_token_ids_ptr[req]
        input_ids_ptr[start:end] = row[done:done + end - start]
        if num_lookahead > 0:
            pos = torch.arange(num_lookahead) + done + end - start
            tokens = torch.where(pos < prefill_len, row[pos.clamp(max=row.shape[0] - 1)], 0)
            next_prefill_tokens_ptr[:num_lookahead, req] = tokens.to(next_prefill_tokens_ptr.dtype)


@grid_kernel
def prepare_pos_seq_lens(grid: Grid, pos_ptr, seq_lens_ptr, idx_mapping_ptr, query_start_loc_ptr,
                         num_computed_tokens_ptr, max_num_reqs, BLOCK_SIZE: int = 1024, **launch) -> None:
    """``seq_lens[i] = num_computed[req] + query_len`` (0 for i >= num_reqs, up to ``max_num_reqs``)
    and each query token's position ``num_computed[req] + j``."""
    num_reqs = grid[0] - 1
    qsl = query_start_loc_ptr[:num_reqs + 1].long()
    query_lens = qsl[1:] - qsl[:-1]
    computed = num_computed_tokens_ptr[idx_mapping_ptr[:num_reqs].long()].long()
    seq_lens_ptr[:num_reqs] = (computed + query_lens).to(seq_lens_ptr.dtype)
    seq_lens_ptr[num_reqs:max_num_reqs] = 0
    num_tokens = int(qsl[-1] - qsl[0]) if num_reqs else 0
    if num_tokens:
        token_req = torch.repeat_interleave(torch.arange(num_reqs), query_lens)
        offsets = torch.arange(num_tokens) - qsl[:-1][token_req] + qsl[0]
        pos_ptr[int(qsl[0]):int(qsl[0]) + num_tokens] = (computed[token_req] + offsets).to(pos_ptr.dtype)


@grid_kernel
def combine_sampled_and_draft_tokens(grid: Grid, input_ids_ptr, idx_mapping_ptr, last_sampled_tokens_ptr,
                                     query_start_loc_ptr, seq_lens_ptr, prefill_len_ptr, draft_tokens_ptr,
                                     draft_tokens_stride, cu_num_logits_ptr, logits_indices_ptr, BLOCK_SIZE: int = 1,
                                     NUM_NEW_SAMPLED_TOKENS: int = 1, **launch) -> None:
    """Per request: its logits' token indices (the last ``num_logits`` of its query) into
    ``logits_indices``; past its prompt, the last sampled token at the first of them (when that
    slot is a generated one) and its draft tokens at the query's end."""
    cu = cu_num_logits_ptr.tolist()
    qsl = query_start_loc_ptr.tolist()
    for batch_idx, req in enumerate(idx_mapping_ptr[:grid[0]].tolist()):
        num_logits = cu[batch_idx + 1] - cu[batch_idx]
        num_draft = num_logits - NUM_NEW_SAMPLED_TOKENS
        query_end = qsl[batch_idx + 1]
        logits_start = query_end - num_logits
        if num_logits > 0:
            logits_indices_ptr[cu[batch_idx]:cu[batch_idx + 1]] = torch.arange(logits_start, query_end)
        seq_len = int(seq_lens_ptr[batch_idx])
        plen = int(prefill_len_ptr[req])
        if seq_len <= plen:
            continue
        if NUM_NEW_SAMPLED_TOKENS > 0 and seq_len - num_logits >= plen:
            input_ids_ptr[logits_start] = last_sampled_tokens_ptr[req]
        if num_draft > 0:
            input_ids_ptr[query_end - num_draft:query_end] = draft_tokens_ptr[req, :num_draft]


@grid_kernel
def get_num_sampled_and_rejected(grid: Grid, num_sampled_ptr, num_rejected_ptr, seq_lens_ptr, cu_num_logits_ptr,
                                 idx_mapping_ptr, prefill_len_ptr, **launch) -> None:
    """``num_rejected = num_logits - num_sampled``; both 0 for a request still chunking its prompt."""
    n = grid[0]
    chunking = seq_lens_ptr[:n].long() < prefill_len_ptr[idx_mapping_ptr[:n].long()].long()
    num_logits = (cu_num_logits_ptr[1:n + 1] - cu_num_logits_ptr[:n]).to(num_sampled_ptr.dtype)
    num_sampled_ptr[:n] = torch.where(chunking, 0, num_sampled_ptr[:n])
    num_rejected_ptr[:n] = torch.where(chunking, 0, num_logits - num_sampled_ptr[:n]).to(num_rejected_ptr.dtype)


@grid_kernel
def post_update(grid: Grid, idx_mapping_ptr, num_computed_tokens_ptr, last_sampled_tokens_ptr, output_bin_counts_ptr,
                output_bin_counts_stride, sampled_tokens_ptr, sampled_tokens_stride, num_sampled_ptr, num_rejected_ptr,
                query_start_loc_ptr, all_token_ids_ptr, all_token_ids_stride, total_len_ptr, draft_tokens_ptr,
                draft_tokens_out_ptr, num_draft_tokens, **launch) -> None:
    """After a step, per request (rows with a negative index skipped): keep its draft tokens, append
    its sampled tokens to ``all_token_ids`` (and their output counts), remember the last one, and
    advance ``num_computed`` by the query length less the rejected tokens."""
    qsl = query_start_loc_ptr.tolist() if query_start_loc_ptr is not None else None
    for req_id, req in enumerate(idx_mapping_ptr[:grid[0]].tolist()):
        if req < 0:
            continue
        if draft_tokens_ptr is not None:
            draft_tokens_out_ptr[req, :num_draft_tokens] = draft_tokens_ptr[req_id, :num_draft_tokens]
        total = int(total_len_ptr[req])
        n = int(num_sampled_ptr[req_id])
        if n > 0:
            tokens = sampled_tokens_ptr[req_id, :n]
            last_sampled_tokens_ptr[req] = tokens[n - 1]
            total_len_ptr[req] = total + n
            all_token_ids_ptr[req, total:total + n] = tokens.to(all_token_ids_ptr.dtype)
            if output_bin_counts_ptr is not None:
                for token in tokens.tolist():  # a token may repeat: counted once per occurrence
                    output_bin_counts_ptr[req, token] += 1
        query_len = qsl[req_id + 1] - qsl[req_id] if qsl is not None else 0
        delta = query_len - int(num_rejected_ptr[req_id])
        if delta != 0:
            num_computed_tokens_ptr[req] += delta


@grid_kernel
def post_update_num_computed_tokens(grid: Grid, idx_mapping_ptr, num_computed_tokens_ptr, query_start_loc_ptr,
                                    **launch) -> None:
    """``num_computed[req] += query_len`` for each request of the batch."""
    n = grid[0]
    query_lens = query_start_loc_ptr[1:n + 1] - query_start_loc_ptr[:n]
    # index_add_: a request listed twice gets both (the kernel's programs would race instead).
    num_computed_tokens_ptr.index_add_(0, idx_mapping_ptr[:n].long(), query_lens.to(num_computed_tokens_ptr.dtype))


@grid_kernel
def expand_idx_mapping(grid: Grid, idx_mapping_ptr, expanded_idx_mapping_ptr, expanded_local_pos_ptr, cu_num_logits_ptr,
                       BLOCK_SIZE: int = 1, **launch) -> None:
    """Each request's state index and local position 0..k-1 repeated over its ``k`` logits."""
    n = grid[0]
    counts = (cu_num_logits_ptr[1:n + 1] - cu_num_logits_ptr[:n]).long()
    start = int(cu_num_logits_ptr[0])
    total = int(counts.sum())
    expanded_idx_mapping_ptr[start:start + total] = torch.repeat_interleave(idx_mapping_ptr[:n], counts)
    firsts = torch.repeat_interleave(cu_num_logits_ptr[:n].long(), counts)
    local = torch.arange(start, start + total) - firsts
    expanded_local_pos_ptr[start:start + total] = local.to(expanded_local_pos_ptr.dtype)


OVERRIDES = {
    f"{_MODULE}._prepare_prefill_inputs_kernel": prepare_prefill_inputs,
    f"{_MODULE}._prepare_pos_seq_lens_kernel": prepare_pos_seq_lens,
    f"{_MODULE}._combine_sampled_and_draft_tokens_kernel": combine_sampled_and_draft_tokens,
    f"{_MODULE}._get_num_sampled_and_rejected_kernel": get_num_sampled_and_rejected,
    f"{_MODULE}._post_update_kernel": post_update,
    f"{_MODULE}._post_update_num_computed_tokens_kernel": post_update_num_computed_tokens,
    f"{_MODULE}._expand_idx_mapping_kernel": expand_idx_mapping,
}

"""The sampler's logits processors: allowed token ids, logit bias and min-tokens
(``sample/logit_bias.py``), bad words (``sample/bad_words.py``) and min-p (``sample/min_p.py``),
all under ``vllm/v1/worker/gpu/``."""

from __future__ import annotations

import torch

from vllm_zerocopy_testbed.kernels._launch import Grid, grid_kernel

_SAMPLE = "vllm.v1.worker.gpu.sample"
_NEG_INF = float("-inf")


@grid_kernel
def bias(grid: Grid, logits_ptr, logits_stride, vocab_size, expanded_idx_mapping_ptr, num_allowed_token_ids_ptr,
         allowed_token_ids_ptr, allowed_token_ids_stride, num_logit_bias_ptr, bias_token_ids_ptr,
         bias_token_ids_stride, bias_ptr, bias_stride, pos_ptr, min_lens_ptr, num_stop_token_ids_ptr,
         restore_when_all_masked_ptr, stop_token_ids_ptr, stop_token_ids_stride, BLOCK_SIZE: int = 1,
         LOGITS_BLOCK_SIZE: int = 8192, CHECK_ALL_MASKED_ROWS: bool = False, **launch) -> None:
    """Per token, in order: only the request's allowed tokens keep their logits (the rest ``-inf``);
    its logit bias added; before ``min_len``, its stop tokens at ``-inf`` (restored where that
    masked the whole row and the request asked for it)."""
    for token_idx in range(grid[0]):
        req = int(expanded_idx_mapping_ptr[token_idx])
        row = logits_ptr[token_idx, :vocab_size]
        n = int(num_allowed_token_ids_ptr[req])
        if n > 0:
            ids = allowed_token_ids_ptr[req, :n].long()
            kept = row[ids].clone()
            row.fill_(_NEG_INF)
            row[ids] = kept
        n = int(num_logit_bias_ptr[req])
        if n > 0:
            ids = bias_token_ids_ptr[req, :n].long()
            row[ids] = row[ids] + bias_ptr[req, :n].to(row.dtype)
        n = int(num_stop_token_ids_ptr[req])
        if n > 0 and int(pos_ptr[token_idx]) + 1 < int(min_lens_ptr[req]):
            ids = stop_token_ids_ptr[req, :n].long()
            if CHECK_ALL_MASKED_ROWS and bool(restore_when_all_masked_ptr[req]):
                stop_logits = row[ids].clone()
                row[ids] = _NEG_INF
                if bool(torch.all(row == _NEG_INF)):
                    finite = torch.isfinite(stop_logits)
                    row[ids[finite]] = stop_logits[finite]
            else:
                row[ids] = _NEG_INF


@grid_kernel
def bad_words(grid: Grid, logits_ptr, logits_stride, expanded_idx_mapping_ptr, bad_word_token_ids_ptr,
              bad_word_token_ids_stride, bad_word_offsets_ptr, bad_word_offsets_stride, num_bad_words_ptr,
              all_token_ids_ptr, all_token_ids_stride, prompt_len_ptr, total_len_ptr, input_ids_ptr,
              expanded_local_pos_ptr, **launch) -> None:
    """Per token and bad word of its request: where the tokens before this one (the request's
    output, then its draft tokens in ``input_ids``) end with the word's prefix, the word's last
    token at ``-inf``."""
    num_tokens, max_bad_words = grid
    for token_idx in range(num_tokens):
        req = int(expanded_idx_mapping_ptr[token_idx])
        pos = int(expanded_local_pos_ptr[token_idx])
        first = token_idx - pos
        prompt_len = int(prompt_len_ptr[req])
        output_len = int(total_len_ptr[req]) - prompt_len
        effective_len = output_len + pos
        offsets = bad_word_offsets_ptr[req].tolist()
        words = bad_word_token_ids_ptr[req]
        for w in range(min(int(num_bad_words_ptr[req]), max_bad_words)):
            start, end = offsets[w], offsets[w + 1]
            prefix_len = end - start - 1
            if prefix_len > effective_len:
                continue
            actual = []
            for i in range(prefix_len):
                at = effective_len - prefix_len + i
                if at >= output_len:  # a draft token: local position 0 is the last committed one
                    actual.append(int(input_ids_ptr[first + at - output_len + 1]))
                else:
                    actual.append(int(all_token_ids_ptr[req, prompt_len + at]))
            if actual == words[start:end - 1].tolist():
                logits_ptr[token_idx, int(words[end - 1])] = _NEG_INF


@grid_kernel
def min_p(grid: Grid, logits_ptr, logits_stride, expanded_idx_mapping_ptr, min_p_ptr, vocab_size,
          BLOCK_SIZE: int = 1024, **launch) -> None:
    """Per token with min-p set: logits below ``max + log(min_p)`` (float32) at ``-inf``."""
    for token_idx in range(grid[0]):
        req = int(expanded_idx_mapping_ptr[token_idx])
        p = min_p_ptr[req].to(torch.float32)
        if float(p) == 0.0:
            continue
        row = logits_ptr[token_idx, :vocab_size]
        threshold = row.max().to(torch.float32) + torch.log(p)
        row.masked_fill_(row < threshold, _NEG_INF)


OVERRIDES = {
    f"{_SAMPLE}.logit_bias._bias_kernel": bias,
    f"{_SAMPLE}.bad_words._bad_words_kernel": bad_words,
    f"{_SAMPLE}.min_p._min_p_kernel": min_p,
}

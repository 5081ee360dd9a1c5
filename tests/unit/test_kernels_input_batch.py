"""The torch batch-preparation kernels against loop references written from their Triton sources
(``vllm/v1/worker/gpu/input_batch.py``, 0.34.0): no vLLM needed."""

from __future__ import annotations

import pytest
import torch

from vllm_zerocopy_testbed.kernels import input_batch as k

pytestmark = pytest.mark.unit


def _batch(gen: torch.Generator, num_reqs: int, max_reqs: int = 8, max_query: int = 6):
    """A random batch: distinct request slots, query lengths (some 0) and their start offsets."""
    idx = torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32)
    qlens = torch.randint(0, max_query, (num_reqs,), generator=gen)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(qlens, 0)
    return idx, qsl


@pytest.mark.parametrize("seed", range(5))
def test_prepare_pos_seq_lens_matches_loop(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_reqs, max_reqs = 5, 8
    idx, qsl = _batch(gen, num_reqs, max_reqs)
    computed = torch.randint(0, 50, (max_reqs,), generator=gen, dtype=torch.int32)
    pos, seq_lens = torch.full((40,), -7, dtype=torch.int64), torch.full((max_reqs,), -7, dtype=torch.int32)
    want_pos, want_seq = pos.clone(), seq_lens.clone()
    for r in range(num_reqs):  # one program per request, the last pads
        req = int(idx[r])
        want_seq[r] = computed[req] + qsl[r + 1] - qsl[r]
        for j in range(int(qsl[r + 1] - qsl[r])):
            want_pos[qsl[r] + j] = computed[req] + j
    for i in range(num_reqs, max_reqs):
        want_seq[i] = 0
    k.prepare_pos_seq_lens[(num_reqs + 1,)](pos, seq_lens, idx, qsl, computed, max_reqs, BLOCK_SIZE=1024)
    assert torch.equal(pos, want_pos) and torch.equal(seq_lens, want_seq)


@pytest.mark.parametrize("seed", range(5))
def test_prepare_prefill_inputs_matches_loop(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_reqs, max_reqs, lookahead = 4, 8, 3
    idx, qsl = _batch(gen, num_reqs, max_reqs)
    all_ids = torch.randint(0, 1000, (max_reqs, 64), generator=gen, dtype=torch.int32)
    prefill = torch.randint(5, 30, (max_reqs,), generator=gen, dtype=torch.int32)
    computed = torch.randint(0, 30, (max_reqs,), generator=gen, dtype=torch.int32)
    input_ids = torch.full((int(qsl[-1]) + 2,), -1, dtype=torch.int32)
    nxt = torch.full((lookahead, max_reqs), -1, dtype=torch.int32)
    want_ids, want_nxt = input_ids.clone(), nxt.clone()
    for r in range(num_reqs):
        req = int(idx[r])
        if computed[req] >= prefill[req]:
            continue
        qlen = int(qsl[r + 1] - qsl[r])
        for j in range(qlen):
            want_ids[qsl[r] + j] = all_ids[req, computed[req] + j]
        for j in range(lookahead):
            p = int(computed[req]) + qlen + j
            want_nxt[j, req] = all_ids[req, p] if p < prefill[req] else 0
    k.prepare_prefill_inputs[(num_reqs,)](input_ids, nxt, nxt.stride(0), lookahead, idx, qsl, all_ids,
                                          all_ids.stride(0), prefill, computed, BLOCK_SIZE=1024, LOOKAHEAD_BLOCK=4)
    assert torch.equal(input_ids, want_ids) and torch.equal(nxt, want_nxt)


@pytest.mark.parametrize("seed", range(5))
def test_combine_sampled_and_draft_tokens_matches_loop(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_reqs, max_reqs, spec = 4, 8, 2
    idx = torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32)
    num_logits = torch.randint(1, spec + 2, (num_reqs,), generator=gen)
    qlens = num_logits + torch.randint(0, 3, (num_reqs,), generator=gen)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(qlens, 0)
    cu = torch.zeros(num_reqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(num_logits, 0)
    seq_lens = torch.randint(1, 40, (num_reqs,), generator=gen, dtype=torch.int32)
    prefill = torch.randint(1, 40, (max_reqs,), generator=gen, dtype=torch.int32)
    last = torch.randint(0, 1000, (max_reqs,), generator=gen, dtype=torch.int32)
    drafts = torch.randint(0, 1000, (max_reqs, spec), generator=gen, dtype=torch.int32)
    input_ids = torch.full((int(qsl[-1]),), -1, dtype=torch.int32)
    logits_idx = torch.full((int(cu[-1]),), -1, dtype=torch.int64)
    want_ids, want_idx = input_ids.clone(), logits_idx.clone()
    for r in range(num_reqs):
        req, n = int(idx[r]), int(cu[r + 1] - cu[r])
        end = int(qsl[r + 1])
        for j in range(n):
            want_idx[cu[r] + j] = end - n + j
        if seq_lens[r] <= prefill[req]:
            continue
        if seq_lens[r] - n >= prefill[req]:
            want_ids[end - n] = last[req]
        for j in range(n - 1):
            want_ids[end - (n - 1) + j] = drafts[req, j]
    k.combine_sampled_and_draft_tokens[(num_reqs,)](input_ids, idx, last, qsl, seq_lens, prefill, drafts,
                                                    drafts.stride(0), cu, logits_idx, BLOCK_SIZE=4,
                                                    NUM_NEW_SAMPLED_TOKENS=1)
    assert torch.equal(input_ids, want_ids) and torch.equal(logits_idx, want_idx)


@pytest.mark.parametrize("seed", range(3))
def test_num_sampled_and_rejected_matches_loop(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_reqs, max_reqs = 5, 8
    idx = torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32)
    cu = torch.zeros(num_reqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.randint(1, 4, (num_reqs,), generator=gen), 0)
    seq_lens = torch.randint(1, 20, (num_reqs,), generator=gen, dtype=torch.int32)
    prefill = torch.randint(1, 20, (max_reqs,), generator=gen, dtype=torch.int32)
    sampled = torch.randint(0, 3, (num_reqs,), generator=gen, dtype=torch.int32)
    rejected = torch.empty_like(sampled)
    want_s, want_r = sampled.clone(), torch.empty_like(sampled)
    for r in range(num_reqs):
        chunking = seq_lens[r] < prefill[idx[r]]
        s = 0 if chunking else int(sampled[r])
        want_s[r] = s
        want_r[r] = 0 if chunking else int(cu[r + 1] - cu[r]) - s
    k.get_num_sampled_and_rejected[(num_reqs,)](sampled, rejected, seq_lens, cu, idx, prefill)
    assert torch.equal(sampled, want_s) and torch.equal(rejected, want_r)


@pytest.mark.parametrize("seed", range(5))
def test_post_update_matches_loop(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_reqs, max_reqs, vocab, spec = 4, 8, 50, 2
    idx = torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32)
    idx[0] = -1  # a skipped row
    computed = torch.randint(0, 20, (max_reqs,), generator=gen, dtype=torch.int32)
    last = torch.zeros(max_reqs, dtype=torch.int32)
    counts = torch.randint(0, 3, (max_reqs, vocab), generator=gen, dtype=torch.int32)
    sampled_tokens = torch.randint(0, vocab, (num_reqs, spec + 1), generator=gen, dtype=torch.int64)
    sampled_tokens[1, :] = 7  # repeats count once each
    num_sampled = torch.randint(0, spec + 2, (num_reqs,), generator=gen, dtype=torch.int32)
    num_rejected = torch.randint(0, 2, (num_reqs,), generator=gen, dtype=torch.int32)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.randint(1, 4, (num_reqs,), generator=gen), 0)
    all_ids = torch.zeros(max_reqs, 64, dtype=torch.int32)
    total = torch.randint(0, 30, (max_reqs,), generator=gen, dtype=torch.int32)
    drafts = torch.randint(0, vocab, (num_reqs, spec), generator=gen, dtype=torch.int32)
    drafts_out = torch.zeros(max_reqs, spec, dtype=torch.int32)
    want = [t.clone() for t in (computed, last, counts, all_ids, total, drafts_out)]
    w_computed, w_last, w_counts, w_all, w_total, w_drafts = want
    for r in range(num_reqs):
        req = int(idx[r])
        if req < 0:
            continue
        for i in range(spec):
            w_drafts[req, i] = drafts[r, i]
        t0, n = int(w_total[req]), int(num_sampled[r])
        if n > 0:
            w_last[req] = sampled_tokens[r, n - 1]
            w_total[req] = t0 + n
        for i in range(n):
            tok = int(sampled_tokens[r, i])
            w_all[req, t0 + i] = tok
            w_counts[req, tok] += 1
        delta = int(qsl[r + 1] - qsl[r]) - int(num_rejected[r])
        w_computed[req] += delta
    k.post_update[(num_reqs,)](idx, computed, last, counts, counts.stride(0), sampled_tokens,
                               sampled_tokens.stride(0), num_sampled, num_rejected, qsl, all_ids, all_ids.stride(0),
                               total, drafts, drafts_out, spec, num_warps=1)
    for got, expected in zip((computed, last, counts, all_ids, total, drafts_out), want):
        assert torch.equal(got, expected)


def test_post_update_num_computed_tokens_and_expand_match_loops() -> None:
    gen = torch.Generator().manual_seed(0)
    num_reqs, max_reqs = 5, 8
    idx = torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.randint(0, 4, (num_reqs,), generator=gen), 0)
    computed = torch.randint(0, 9, (max_reqs,), generator=gen, dtype=torch.int32)
    want = computed.clone()
    for r in range(num_reqs):
        want[idx[r]] += qsl[r + 1] - qsl[r]
    k.post_update_num_computed_tokens[(num_reqs,)](idx, computed, qsl)
    assert torch.equal(computed, want)

    cu = torch.zeros(num_reqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.randint(1, 4, (num_reqs,), generator=gen), 0)
    total = int(cu[-1])
    expanded, local = idx.new_full((total,), -1), torch.full((total,), -1, dtype=torch.int32)
    want_e, want_l = expanded.clone(), local.clone()
    for r in range(num_reqs):
        for j in range(int(cu[r + 1] - cu[r])):
            want_e[cu[r] + j], want_l[cu[r] + j] = idx[r], j
    k.expand_idx_mapping[(num_reqs,)](idx, expanded, local, cu, BLOCK_SIZE=4)
    assert torch.equal(expanded, want_e) and torch.equal(local, want_l)

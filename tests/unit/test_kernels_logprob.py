"""The torch logprob, grammar-bitmask and prompt-embeds kernels against loop references written
from their Triton sources (``vllm/v1/worker/gpu/sample/{logprob,prompt_logprob}.py``,
``structured_outputs.py``, ``model_states/prompt_embeds.py``, 0.34.0): no vLLM needed."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_zerocopy_testbed.kernels import logprob as k
from vllm_zerocopy_testbed.kernels.prompt_embeds import apply_prompt_embeds
from vllm_zerocopy_testbed.kernels.structured_outputs import apply_grammar_bitmask

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("seed", range(3))
def test_topk_log_softmax_and_ranks_match_loops(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows, vocab, topk = 3, 500, 4
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64).to(torch.float32)
    ids = torch.randint(0, vocab, (rows, topk), generator=gen)
    out = torch.empty(rows, topk)
    k.topk_log_softmax[(rows,)](out, logits, vocab, ids, topk, topk, vocab, BLOCK_SIZE=1024, TOPK_BLOCK_SIZE=4)
    for r in range(rows):
        row = logits[r].tolist()
        top = max(row)
        lse = math.log(sum(math.exp(x - top) for x in row))
        for j in range(topk):
            assert out[r, j].item() == pytest.approx(row[int(ids[r, j])] - top - lse, abs=1e-5)
    ranks = torch.empty(rows, dtype=torch.int64)
    chosen = ids[:, 0].contiguous()
    k.ranks[(rows,)](ranks, logits, vocab, chosen, vocab, BLOCK_SIZE=8192)
    for r in range(rows):
        x = logits[r, chosen[r]].item()
        assert int(ranks[r]) == sum(1 for y in logits[r].tolist() if y >= x)


def test_fill_logprob_token_ids_matches_loop() -> None:
    rows, num_topk, cols = 3, 2, 4
    out = torch.zeros(rows, 1 + cols, dtype=torch.int64)
    valid = torch.zeros_like(out, dtype=torch.bool)
    sampled = torch.tensor([7, 8, 9])
    topk = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    idx = torch.tensor([2, 0, 1], dtype=torch.int32)
    num_custom = torch.tensor([0, 3, 0], dtype=torch.int32)
    custom = torch.tensor([[0] * 4, [11, 12, 13, 0], [0] * 4], dtype=torch.int32)
    k.fill_logprob_token_ids[(rows,)](out, out.stride(0), valid, valid.stride(0), sampled, topk, topk.stride(0), idx,
                                      num_custom, custom, custom.stride(0), NUM_TOPK=num_topk, PADDED_COLS=4)
    want, want_valid = torch.zeros_like(out), torch.zeros_like(valid)
    for r in range(rows):
        want[r, 0], want_valid[r, 0] = sampled[r], True
        req = int(idx[r])
        src = custom[req, :num_custom[req]] if num_custom[req] > 0 else topk[r, :num_topk]
        for j, token in enumerate(src.tolist()):
            want[r, 1 + j], want_valid[r, 1 + j] = token, True
    assert torch.equal(out, want) and torch.equal(valid, want_valid)


def test_prompt_logprobs_token_ids_matches_loop() -> None:
    all_ids = torch.arange(100, dtype=torch.int32).view(4, 25)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    qsl = torch.tensor([0, 4, 7], dtype=torch.int32)
    computed = torch.tensor([0, 5, 0, 2], dtype=torch.int32)
    out = torch.full((7,), -1, dtype=torch.int64)
    k.prompt_logprobs_token_ids[(2,)](out, qsl, idx, computed, all_ids, all_ids.stride(0), BLOCK_SIZE=1024)
    want = [int(all_ids[idx[r], computed[idx[r]] + 1 + j]) for r in range(2) for j in range(int(qsl[r + 1] - qsl[r]))]
    assert out.tolist() == want


def test_grammar_bitmask_matches_loop() -> None:
    gen = torch.Generator().manual_seed(4)
    vocab, mask_stride = 70, 2
    logits = torch.randn(5, vocab, generator=gen)
    cu = torch.tensor([0, 2, 3, 5], dtype=torch.int32)  # request 1 has one logit: its position 1 is skipped
    mapping = torch.tensor([0 * 2 + 1, 1 * 2 + 0, 1 * 2 + 1, 2 * 2 + 0], dtype=torch.int32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, math.ceil(vocab / 32)), generator=gen, dtype=torch.int32)
    want = logits.clone()
    for m in range(4):
        req, position = divmod(int(mapping[m]), mask_stride)
        if position >= int(cu[req + 1] - cu[req]):
            continue
        for t in range(vocab):
            if not (int(bitmask[m, t // 32]) >> (t % 32)) & 1:
                want[int(cu[req]) + position, t] = -math.inf
    apply_grammar_bitmask[(4, 1)](logits, vocab, mapping, cu, bitmask, bitmask.stride(0), vocab,
                                  MASK_STRIDE=mask_stride,
                                  BLOCK_SIZE=8192)
    assert torch.equal(logits, want)


def test_prompt_embeds_match_loop() -> None:
    gen = torch.Generator().manual_seed(5)
    hidden = 6
    embeds = [torch.randn(5, hidden, generator=gen), torch.randn(2, hidden, generator=gen)]
    is_token = torch.tensor([0, 1, 0, 0, 1], dtype=torch.uint8)
    ptrs = torch.tensor([embeds[0].data_ptr(), embeds[1].data_ptr(), 0], dtype=torch.uint64)
    mask_ptrs = torch.tensor([is_token.data_ptr(), 0, 0], dtype=torch.uint64)
    lens = torch.tensor([5, 2, 0], dtype=torch.int32)
    idx = torch.tensor([1, 0, 2], dtype=torch.int32)
    qsl = torch.tensor([0, 3, 7, 9], dtype=torch.int32)
    computed = torch.tensor([1, 0, 0], dtype=torch.int32)
    inputs = torch.zeros(9, hidden)
    want = inputs.clone()
    for b in range(3):
        req = int(idx[b])
        done, n = int(computed[req]), int(lens[req])
        if done >= n:
            continue
        for t in range(min(int(qsl[b + 1] - qsl[b]), n - done)):
            if req == 0 and is_token[done + t]:
                continue
            want[int(qsl[b]) + t] = embeds[req][done + t]
    apply_prompt_embeds[(3, 1)](inputs, inputs.stride(0), ptrs, mask_ptrs, lens, idx, qsl, computed, hidden,
                                TOKEN_BLOCK=16, BLOCK_SIZE=1024)
    assert torch.equal(inputs, want)

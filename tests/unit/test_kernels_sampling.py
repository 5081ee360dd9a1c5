"""The torch sampling kernels against loop references written from their Triton sources
(``vllm/v1/worker/gpu/sample/{gumbel,penalties,logit_bias,bad_words,min_p}.py``, 0.34.0): no vLLM
needed. The noise hash is checked against murmur3 in plain Python integers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vllm_zerocopy_testbed.kernels import logits_processors as lp
from vllm_zerocopy_testbed.kernels import penalties as pen
from vllm_zerocopy_testbed.kernels import sampling as s

pytestmark = pytest.mark.unit
M32 = 0xFFFFFFFF


def _rotl(v: int, r: int) -> int:
    return ((v << r) | (v >> (32 - r))) & M32


def _mix(h: int, key: int) -> int:
    key = (key * 0xCC9E2D51) & M32
    key = _rotl(key, 15)
    key = (key * 0x1B873593) & M32
    h ^= key
    h = _rotl(h, 13)
    return (h * 5 + 0xE6546B64) & M32


def _murmur3(seed: int, pos: int, offset: int, domain: int = 0) -> int:
    h = domain
    for word in (seed & M32, (seed >> 32) & M32, pos & M32, offset & M32):
        h = _mix(h, word)
    h ^= 16
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**40 + 7, -3, 2**63 - 1])
def test_murmur3_matches_python_integers(seed: int) -> None:
    offsets = torch.tensor([0, 1, 2, 511, 65535, 2**31 + 5])
    for domain in (0, 0x9E3779B9):
        got = s.murmur3_hash32(seed, 17, offsets, domain=domain).tolist()
        assert got == [_murmur3(seed, 17, o, domain) for o in offsets.tolist()]


def test_uniforms_are_open_and_match_their_formula() -> None:
    offsets = torch.arange(4096)
    u32 = s.murmur3_uniform32(5, 3, offsets)
    assert u32.dtype == torch.float32 and bool((u32 > 0).all() and (u32 < 1).all())
    h = _murmur3(5, 3, 100)
    want = np.float32(np.float32(h >> 16) * np.float32(1.52587890625e-05)
                      + (np.float32(h & 0xFFFF) + np.float32(0.5)) * np.float32(2.3283064365386963e-10))
    assert float(u32[100]) == float(want)
    u64 = s.murmur3_uniform64(5, 3, offsets)
    r53 = (((_murmur3(5, 3, 100, 0x9E3779B9) << 32) | _murmur3(5, 3, 100)) >> 11)
    assert float(u64[100]) == (r53 + 0.5) * 1.1102230246251565e-16


def _loop_gumbel(row: torch.Tensor, seed: int, pos: int, temp: float, use_fp64: bool) -> int:
    """The Triton source per element: divide, hash noise per token id, first maximum."""
    best, best_i = -math.inf, 0
    for i, x in enumerate(row.tolist()):
        x = np.float32(x)
        if temp != 0.0:
            x = np.float32(x / np.float32(temp))
            if use_fp64:
                r53 = (((_murmur3(seed, pos, i, 0x9E3779B9) << 32) | _murmur3(seed, pos, i)) >> 11)
                u = (r53 + 0.5) * 1.1102230246251565e-16
                x = float(x) - math.log(-math.log(u))
            else:
                h = _murmur3(seed, pos, i)
                u = np.float32(np.float32(h >> 16) * np.float32(1.52587890625e-05)
                               + (np.float32(h & 0xFFFF) + np.float32(0.5)) * np.float32(2.3283064365386963e-10))
                if u < 0.25:
                    poly = np.float32(1.0 / 8.0)
                    for k in (7, 6, 5, 4, 3, 2):
                        poly = np.float32(np.float32(1.0 / k) + u * poly)
                    poly = np.float32(1.0 + u * poly)
                    log1p = np.float32(-u * poly)
                else:
                    log1p = np.float32(math.log(max(np.float32(1.0 - u), 5.960464477539063e-08)))
                x = np.float32(x + np.float32(-math.log(-log1p)))
        if x > best:
            best, best_i = x, i
    return best_i


@pytest.mark.parametrize("use_fp64", [False, True])
def test_gumbel_sample_matches_loop(use_fp64: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens, vocab = 6, 2500
    logits = torch.randn(num_tokens, vocab, generator=gen) * 3
    idx = torch.tensor([0, 1, 2, 3, 1, 0], dtype=torch.int32)
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3])
    seeds = torch.tensor([11, 22, 2**35 + 1, 7], dtype=torch.int64)
    pos = torch.tensor([3, 9, 0, 41, 10, 4], dtype=torch.int64)
    block = 1024
    blocks = math.ceil(vocab / block)
    local_argmax = torch.empty(num_tokens, blocks, dtype=torch.int64)
    local_max = torch.empty(num_tokens, blocks, dtype=torch.float64 if use_fp64 else torch.float32)
    s.gumbel_sample[(num_tokens, blocks)](local_argmax, blocks, local_max, blocks, None, 0, 0, None, None, 0, None,
                                          logits, vocab, None, 0, idx, seeds, pos, temp, vocab, BLOCK_SIZE=block,
                                          IS_DRAFTING=False, APPLY_TEMPERATURE=True, USE_FP64=use_fp64,
                                          PER_TOKEN_COL=False, HAS_BIAS=False)
    sampled = torch.empty(num_tokens, dtype=torch.int64)
    s.gumbel_combine[(num_tokens,)](local_argmax, blocks, local_max, blocks, sampled, blocks, PADDED_NUM_BLOCKS=4)
    for t in range(num_tokens):
        req = int(idx[t])
        assert int(sampled[t]) == _loop_gumbel(logits[t], int(seeds[req]), int(pos[t]), float(temp[req]), use_fp64)
    assert int(sampled[0]) == int(torch.argmax(logits[0]))  # temperature 0: greedy


def test_temperature_and_min_p_match_loops() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 300, generator=gen)
    idx = torch.tensor([2, 0, 1, 3], dtype=torch.int32)
    temp = torch.tensor([0.0, 1.0, 0.5, 2.0])
    want = logits.clone()
    for t in range(4):
        tau = float(temp[idx[t]])
        if tau not in (0.0, 1.0):
            for i in range(300):
                want[t, i] = float(np.float32(want[t, i].item()) / np.float32(tau))
    s.temperature[(4, 1)](logits, 300, idx, temp, 300, BLOCK_SIZE=8192)
    assert torch.equal(logits, want)

    min_p = torch.tensor([0.0, 0.2, 0.05, 0.9])
    want = logits.clone()
    for t in range(4):
        p = float(min_p[idx[t]])
        if p:
            threshold = np.float32(float(want[t].max())) + np.float32(math.log(np.float32(p)))
            for i in range(300):
                if want[t, i] < threshold:
                    want[t, i] = -math.inf
    lp.min_p[(4,)](logits, 300, idx, min_p, 300, BLOCK_SIZE=1024)
    assert torch.equal(logits, want)


def test_bincount_then_penalties_match_loops() -> None:
    gen = torch.Generator().manual_seed(2)
    max_reqs, vocab = 4, 70
    all_ids = torch.randint(0, vocab, (max_reqs, 40), generator=gen, dtype=torch.int32)
    prompt_len = torch.tensor([5, 12, 3, 20], dtype=torch.int32)
    prefill_len = torch.tensor([9, 12, 10, 25], dtype=torch.int32)
    mask = torch.zeros(max_reqs, math.ceil(vocab / 32), dtype=torch.int32)
    counts = torch.zeros(max_reqs, vocab, dtype=torch.int32)
    reqs = torch.tensor([3, 0, 2], dtype=torch.int64)
    pen.bincount[(3, 1)](reqs, all_ids, all_ids.stride(0), prompt_len, prefill_len, mask, mask.stride(0), counts,
                         counts.stride(0), BLOCK_SIZE=1024)
    for req in reqs.tolist():
        in_prompt = set(all_ids[req, :prompt_len[req]].tolist())
        for t in range(vocab):
            assert bool((int(mask[req, t // 32]) >> (t % 32)) & 1) == (t in in_prompt)
        out = all_ids[req, prompt_len[req]:prefill_len[req]].tolist()
        assert counts[req].tolist() == [out.count(t) for t in range(vocab)]

    logits = torch.randn(4, vocab, generator=gen)
    idx = torch.tensor([0, 3, 3, 2], dtype=torch.int32)  # request 3: a token and its draft
    local_pos = torch.tensor([0, 0, 1, 0], dtype=torch.int32)
    token_ids = torch.randint(0, vocab, (4,), generator=gen, dtype=torch.int32)
    rep = torch.tensor([1.3, 1.0, 1.0, 1.2])
    freq = torch.tensor([0.5, 0.0, 0.0, -0.2])
    pres = torch.tensor([0.25, 0.0, 0.0, 0.4])
    want = logits.clone()
    for t in range(4):
        req = int(idx[t])
        if rep[req] == 1.0 and freq[req] == 0.0 and pres[req] == 0.0:
            continue
        c = counts[req].tolist()
        for prev in range(int(local_pos[t])):
            c[int(token_ids[t - int(local_pos[t]) + prev + 1])] += 1
        for i in range(vocab):
            x = np.float32(want[t, i].item())
            seen = c[i] > 0
            if rep[req] != 1.0:
                in_prompt = (int(mask[req, i // 32]) >> (i % 32)) & 1
                scale = np.float32(rep[req].item()) if (in_prompt or seen) else np.float32(1.0)
                x = np.float32(x * (np.float32(1.0) / scale if x > 0 else scale))
            x = np.float32(x - np.float32(freq[req].item()) * np.float32(c[i]))
            x = np.float32(x - np.float32(pres[req].item()) * np.float32(seen))
            want[t, i] = float(x)
    pen.penalties[(4, 1)](logits, vocab, idx, token_ids, local_pos, rep, freq, pres, mask, mask.stride(0), counts,
                          counts.stride(0), vocab, BLOCK_SIZE=8192)
    assert torch.equal(logits, want)


def test_bias_allowed_ids_and_min_tokens_match_loop() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab, width = 40, 4
    logits = torch.randn(3, vocab, generator=gen)
    idx = torch.tensor([0, 1, 2], dtype=torch.int32)
    n_allowed = torch.tensor([2, 0, 0], dtype=torch.int32)
    allowed = torch.tensor([[5, 9, 0, 0], [0] * 4, [0] * 4], dtype=torch.int32)
    n_bias = torch.tensor([1, 2, 0], dtype=torch.int32)
    bias_ids = torch.tensor([[9, 0, 0, 0], [3, 4, 0, 0], [0] * 4], dtype=torch.int32)
    bias = torch.tensor([[1.5, 0, 0, 0], [-2.0, 0.25, 0, 0], [0] * 4])
    pos = torch.tensor([1, 1, 1], dtype=torch.int64)
    min_lens = torch.tensor([0, 0, 5], dtype=torch.int32)
    n_stop = torch.tensor([0, 0, 2], dtype=torch.int32)
    stop = torch.tensor([[0] * 4, [0] * 4, [7, 8, 0, 0]], dtype=torch.int32)
    want = logits.clone()
    for t in range(3):
        req = int(idx[t])
        if n_allowed[req] > 0:
            keep = {int(i): float(want[t, int(i)]) for i in allowed[req, :n_allowed[req]]}
            for i in range(vocab):
                want[t, i] = keep.get(i, -math.inf)
        for j in range(int(n_bias[req])):
            want[t, bias_ids[req, j]] += bias[req, j]
        if n_stop[req] > 0 and pos[t] + 1 < min_lens[req]:
            for j in range(int(n_stop[req])):
                want[t, stop[req, j]] = -math.inf
    lp.bias[(3,)](logits, vocab, vocab, idx, n_allowed, allowed, width, n_bias, bias_ids, width, bias, width, pos,
                  min_lens, n_stop, torch.zeros(3, dtype=torch.bool), stop, width, BLOCK_SIZE=4,
                  LOGITS_BLOCK_SIZE=8192, CHECK_ALL_MASKED_ROWS=False)
    assert torch.equal(logits, want)


def test_bad_words_match_loop() -> None:
    vocab = 20
    logits = torch.zeros(2, vocab)
    idx = torch.tensor([0, 1], dtype=torch.int32)
    # request 0: words [4, 5] and [6]; request 1: [1, 2, 3]
    words = torch.tensor([[4, 5, 6, 0], [1, 2, 3, 0]], dtype=torch.int32)
    offsets = torch.tensor([[0, 2, 3], [0, 3, 3]], dtype=torch.int32)
    num = torch.tensor([2, 1], dtype=torch.int32)
    all_ids = torch.tensor([[9, 9, 4, 0, 0], [9, 1, 2, 0, 0]], dtype=torch.int32)  # prompt 1 token, then output
    prompt_len = torch.tensor([1, 1], dtype=torch.int32)
    total_len = torch.tensor([3, 3], dtype=torch.int32)
    lp.bad_words[(2, 2)](logits, vocab, idx, words, 4, offsets, 3, num, all_ids, 5, prompt_len, total_len,
                         torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    barred = {(t, i) for t in range(2) for i in range(vocab) if logits[t, i] == -math.inf}
    # request 0's output ends with 4: bars 5 (word [4, 5]) and 6 (word [6]); request 1's ends 1, 2: bars 3.
    assert barred == {(0, 5), (0, 6), (1, 3)}

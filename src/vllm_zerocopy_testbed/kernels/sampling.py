"""Temperature and Gumbel-max sampling (``vllm/v1/worker/gpu/sample/gumbel.py``).

The noise is vLLM's counter-based one: a murmur3 hash of (seed, position, token id) turned into a
uniform, so a token's noise depends on nothing else and a repeat with the same seed samples the
same tokens. Hashing is done in int64 lanes holding uint32 values.
"""

from __future__ import annotations

import torch

from vllm_zerocopy_testbed.kernels._launch import Grid, grid_kernel

_MODULE = "vllm.v1.worker.gpu.sample.gumbel"
_U32 = 0xFFFFFFFF
_DRAFT_NOISE_SALT = 1 << 30


def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """``a * b mod 2**32`` for uint32 values in int64 lanes, without leaving int64's range."""
    return (a * (b & 0xFFFF) + (((a * (b >> 16)) & 0xFFFF) << 16)) & _U32


def _rotl32(value: torch.Tensor, shift: int) -> torch.Tensor:
    return ((value << shift) & _U32) | (value >> (32 - shift))


def _mix(h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    key = _mul32(key, 0xCC9E2D51)
    key = _rotl32(key, 15)
    key = _mul32(key, 0x1B873593)
    h = h ^ key
    h = _rotl32(h, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _U32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur3_hash32(seed: int, pos: int, offset: torch.Tensor, domain: int = 0) -> torch.Tensor:
    """vLLM's ``murmur3_hash32``: uint32 hashes of (seed, pos, each offset), as int64 values."""
    offset = offset.long() & _U32
    h = torch.full_like(offset, domain & _U32)
    for word in (seed & _U32, (seed >> 32) & _U32, pos & _U32):
        h = _mix(h, torch.full_like(offset, word))
    h = _mix(h, offset)
    return _fmix32(h ^ 16)


def murmur3_uniform32(seed: int, pos: int, offset: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), float32, from the hash's 32 bits (its two 16-bit halves summed in fp32)."""
    random32 = murmur3_hash32(seed, pos, offset)
    hi16 = (random32 >> 16).to(torch.float32)
    lo16 = (random32 & 0xFFFF).to(torch.float32)
    return hi16 * 2.0**-16 + (lo16 + 0.5) * 2.0**-32


def murmur3_uniform64(seed: int, pos: int, offset: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), float64, from 53 bits of two hashes."""
    lo = murmur3_hash32(seed, pos, offset)
    hi = murmur3_hash32(seed, pos, offset, domain=0x9E3779B9)
    random53 = (hi << 21) | (lo >> 11)  # ((hi << 32) | lo) >> 11, within int64
    uniform = (random53.to(torch.float64) + 0.5) * 2.0**-53
    return torch.where(uniform == 1.0, uniform - 2.0**-53, uniform)


def _log1p_neg_stable(value: torch.Tensor) -> torch.Tensor:
    """``log(1 - value)`` as vLLM computes it: a degree-8 series below 0.25, else directly."""
    polynomial = torch.full_like(value, 1.0 / 8.0)
    for k in (7, 6, 5, 4, 3, 2):
        polynomial = 1.0 / k + value * polynomial
    polynomial = 1.0 + value * polynomial
    series = -value * polynomial
    direct = torch.log(torch.clamp(1.0 - value, min=2.0**-24))
    return torch.where(value < 0.25, series, direct)


def gumbel_noised(logits: torch.Tensor, seed: int, pos: int, temp: float, is_drafting: bool, use_fp64: bool,
                  apply_temperature: bool) -> torch.Tensor:
    """One row's logits (float32) as ``gumbel_noised_argmax`` compares them: divided by ``temp``
    and Gumbel-noised, or as they are at temperature 0."""
    if temp != 0.0 and apply_temperature:
        logits = logits / temp
    if use_fp64:
        logits = logits.to(torch.float64)
    if temp == 0.0:
        return logits
    if is_drafting:
        pos += _DRAFT_NOISE_SALT
    keys = torch.arange(logits.shape[0], dtype=torch.int64)
    if use_fp64:
        noise = -torch.log(-torch.log(murmur3_uniform64(seed, pos, keys)))
    else:
        noise = -torch.log(-_log1p_neg_stable(murmur3_uniform32(seed, pos, keys)))
    return logits + noise


@grid_kernel
def temperature(grid: Grid, logits_ptr, logits_stride, expanded_idx_mapping_ptr, temperature_ptr, vocab_size,
                BLOCK_SIZE: int = 8192, **launch) -> None:
    """Divide each token's logits (in float32) by its request's temperature, except at 0 and 1."""
    for token_idx, req in enumerate(expanded_idx_mapping_ptr[:grid[0]].tolist()):
        temp = float(temperature_ptr[req].to(torch.float32))
        if temp in (0.0, 1.0):
            continue
        row = logits_ptr[token_idx, :vocab_size]
        row.copy_(row.to(torch.float32) / temp)


@grid_kernel
def gumbel_sample(grid: Grid, local_argmax_ptr, local_argmax_stride, local_max_ptr, local_max_stride,
                  logits_cache_ptr, logits_cache_stride_0, logits_cache_stride_1, logits_cache_col_ptr,
                  logits_cache_source_ptr, logits_cache_source_stride, logits_cache_row_mapping_ptr, logits_ptr,
                  logits_stride, bias_ptr, bias_stride, expanded_idx_mapping_ptr, seeds_ptr, pos_ptr, temp_ptr,
                  vocab_size, BLOCK_SIZE: int = 1024, IS_DRAFTING: bool = False, APPLY_TEMPERATURE: bool = False,
                  USE_FP64: bool = False, PER_TOKEN_COL: bool = False, HAS_BIAS: bool = False, **launch) -> None:
    """Per token and vocabulary block of ``BLOCK_SIZE``: the block's winner under Gumbel-max
    (first maximum; plain argmax at temperature 0) into ``local_argmax`` and its value into
    ``local_max``."""
    if logits_cache_ptr is not None:
        raise NotImplementedError("Gumbel sampling into a draft logits cache (speculative decoding)")
    num_tokens, num_blocks = grid
    for token_idx in range(num_tokens):
        req = int(expanded_idx_mapping_ptr[token_idx])
        valid = req >= 0
        temp = float(temp_ptr[req].to(torch.float32)) if valid else 0.0
        seed = int(seeds_ptr[req]) if valid else 0
        row = logits_ptr[token_idx, :vocab_size]
        if HAS_BIAS:
            row = (row.to(torch.float32) + bias_ptr[token_idx, :vocab_size].to(torch.float32)).to(row.dtype)
        noised = gumbel_noised(row.to(torch.float32), seed, int(pos_ptr[token_idx]), temp, IS_DRAFTING, USE_FP64,
                               APPLY_TEMPERATURE)
        # Past the vocabulary the kernel's masked lanes hold -inf: pad to whole blocks with it.
        blocks = torch.full((num_blocks * BLOCK_SIZE,), float("-inf"), dtype=noised.dtype)
        blocks[:vocab_size] = noised
        blocks = blocks.view(num_blocks, BLOCK_SIZE)
        winners = torch.argmax(blocks, dim=1)  # first maximum (first NaN) per block
        local_argmax_ptr[token_idx, :num_blocks] = winners + torch.arange(num_blocks) * BLOCK_SIZE
        local_max_ptr[token_idx, :num_blocks] = blocks.gather(1, winners[:, None])[:, 0].to(local_max_ptr.dtype)


@grid_kernel
def gumbel_combine(grid: Grid, local_argmax_ptr, local_argmax_stride, local_max_ptr, local_max_stride, sampled_ptr,
                   num_blocks, PADDED_NUM_BLOCKS: int = 1, **launch) -> None:
    """Per token, the winning block's token: the first NaN's block, else the first maximum's."""
    values = local_max_ptr[:grid[0], :num_blocks]
    winners = torch.argmax(values, dim=1)  # torch.argmax: first NaN, else first maximum
    sampled_ptr[:grid[0]] = local_argmax_ptr[:grid[0], :num_blocks].gather(1, winners[:, None])[:, 0]


OVERRIDES = {
    f"{_MODULE}._temperature_kernel": temperature,
    f"{_MODULE}._gumbel_sample_kernel": gumbel_sample,
    f"{_MODULE}._gumbel_combine_kernel": gumbel_combine,
}

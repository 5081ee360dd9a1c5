"""Grammar bitmasks (``vllm/v1/worker/gpu/structured_outputs.py``): ``_apply_grammar_bitmask_kernel``."""

from __future__ import annotations

import torch

from vllm_zerocopy_testbed.kernels._launch import Grid, grid_kernel

_MODULE = "vllm.v1.worker.gpu.structured_outputs"


def unpack_bitmask(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [rows, vocab_size]: True where a token is allowed (bit ``t % 32`` of word ``t // 32``)."""
    bits = torch.arange(32, dtype=torch.int32)
    unpacked = (packed[:, :, None].to(torch.int32) >> bits) & 1
    allowed = unpacked.reshape(packed.shape[0], -1)[:, :vocab_size] != 0
    if allowed.shape[1] < vocab_size:  # words past the mask's stride: the kernel does not load them (0: barred)
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    return allowed


@grid_kernel
def apply_grammar_bitmask(grid: Grid, logits_ptr, logits_stride, logits_indices_ptr, cu_num_logits_ptr, bitmask_ptr,
                          bitmask_stride, vocab_size, MASK_STRIDE: int = 1, BLOCK_SIZE: int = 8192,
                          **launch) -> None:
    """Set ``-inf`` on each masked row's barred tokens: row ``i`` of the bitmask belongs to logits row
    ``cu_num_logits[m // MASK_STRIDE] + m % MASK_STRIDE`` (``m = logits_indices[i]``), skipped where
    that position is past the request's logits."""
    num_masks = grid[0]
    allowed = unpack_bitmask(bitmask_ptr[:num_masks, :bitmask_stride], vocab_size)
    cu = cu_num_logits_ptr.tolist()
    for i, mapping in enumerate(logits_indices_ptr[:num_masks].tolist()):
        req, position = divmod(mapping, MASK_STRIDE)
        if position >= cu[req + 1] - cu[req]:
            continue
        logits_ptr[cu[req] + position, :vocab_size].masked_fill_(~allowed[i], float("-inf"))


OVERRIDES = {f"{_MODULE}._apply_grammar_bitmask_kernel": apply_grammar_bitmask}

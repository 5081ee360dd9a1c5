"""Staged row writes (``vllm/v1/worker/gpu/buffer_utils.py``): ``_apply_write_kernel``."""

from __future__ import annotations

import torch

from vllm_zerocopy_testbed.kernels._launch import Grid, at_address, flat, grid_kernel


@grid_kernel
def apply_write(grid: Grid, output_ptr, output_stride, write_indices_ptr, write_starts_ptr, write_contents_ptr,
                write_cu_lens_ptr, write_group_ids_ptr, BLOCK_SIZE: int = 1024, MULTI_GROUP: bool = False,
                **launch) -> None:
    """Write i (one per program on axis 0): ``contents[cu_lens[i-1]:cu_lens[i]]`` into row
    ``indices[i]`` from column ``starts[i]`` of the output (with ``MULTI_GROUP``, of the tensor whose
    address is ``output_ptr[group_ids[i]]``, row stride ``output_stride[group_ids[i]]``, int32)."""
    num_writes = grid[0]
    indices = write_indices_ptr[:num_writes].tolist()
    starts = write_starts_ptr[:num_writes].tolist()
    cu_lens = write_cu_lens_ptr[:num_writes].tolist()
    groups = write_group_ids_ptr[:num_writes].tolist() if MULTI_GROUP else None
    out = None if MULTI_GROUP else flat(output_ptr)
    prev = 0
    for i in range(num_writes):
        length = cu_lens[i] - prev
        if MULTI_GROUP:
            stride = int(output_stride[groups[i]])
            begin = indices[i] * stride + starts[i]
            target = at_address(int(output_ptr.view(torch.int64)[groups[i]]) + 4 * begin, torch.int32, length)
        else:
            begin = indices[i] * output_stride + starts[i]
            target = out[begin:begin + length]
        target.copy_(write_contents_ptr[prev:prev + length])
        prev = cu_lens[i]


OVERRIDES = {"vllm.v1.worker.gpu.buffer_utils._apply_write_kernel": apply_write}

"""The launch side of a torch kernel: ``kernel[grid](...)`` as vLLM's call sites write it, and
raw addresses (vLLM's pointer tables) as tensors."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import torch

Grid = tuple[int, ...]


class GridKernel:
    """A torch function launched like a Triton kernel: ``k[grid](*args, **kwargs)`` calls
    ``fn(grid, *args, **kwargs)``; the grid is the launch's own (programs per axis), which some
    kernels read (the last program pads). Launch options (``num_warps``) reach ``fn`` as keywords."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)  # name and docstring: the dispatcher logs the name

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
        return functools.partial(self.fn, grid)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{self.__name__} is launched as kernel[grid](...), as its Triton original")


def grid_kernel(fn: Callable[..., Any]) -> GridKernel:
    """Decorator: ``fn(grid, *kernel_args, **constexprs)`` as a ``GridKernel``."""
    return GridKernel(fn)


def flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of ``t``'s storage from its first element on: what a Triton pointer to it sees."""
    return t.as_strided((t.untyped_storage().nbytes() // t.element_size() - t.storage_offset(),), (1,),
                        t.storage_offset())


def at_address(address: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A tensor over ``numel`` elements of ``dtype`` at host ``address`` (no copy): a pointer table's
    entry (``_load_ptr``) as the tensor it points into. The caller keeps that tensor alive."""
    if numel <= 0:
        return torch.empty(0, dtype=dtype)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=dtype, count=numel)

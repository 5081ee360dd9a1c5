"""The shared-memory tensor arena (vLLM 0.32, ``--enable-shm-tensor-arena``): ours, ``off``, ``upstream``.

With the arena on a ``MessageQueue`` (multiprocessing executor, local readers only), the
writer's pickler copies each contiguous CPU tensor >= 8 MiB once into one of 8 slots of
256 MiB and pickles a stub; each reader rebuilds a view of the slot, and the slot is
released once every reader freed its view (``ShmTensorArena``). Upstream's writer finds
that pickler as ``shm_tensor_arena._ArenaPickler`` at every ``enqueue``, and so does the
testbed's ``enqueue`` (``broadcast.serialize``): the mode switch is which class sits there.

* ``upstream``: vLLM's pickler as installed.
* ``off``: the behaviour before the arena: a pickler that ignores it (tensors take the
  out-of-band path of ``TESTBED_BROADCAST``).
* ``testbed``: ours, for two faults measured in vLLM 0.32.0 (tests/component/test_tensor_arena.py,
  docs/design.md "The tensor arena"):

  - every reader's view maps the same shared pages, so a reader that writes its tensor
    changes the other readers' (bytes the writer never sent). Ours rebuilds each tensor over
    a private copy-on-write mapping of its slot: reads share the pages, a write copies one.
  - a slot is claimed while the message is pickled; an ``enqueue`` that fails before the
    message is published (unpicklable member, the ring's timeout) leaves it claimed and
    never read, so never released: each such failure takes one of the 8 slots for good.
    Ours records the claims and frees them when the ``enqueue`` published nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import weakref
from typing import Any, Callable

import numpy as np
import torch

from vllm_zerocopy_testbed.config import PatchMode

SHM_DIR = "/dev/shm"

_installed_pickler: type | None = None
_mode: PatchMode = PatchMode.UPSTREAM


def _arena_module() -> Any | None:
    try:
        from vllm.distributed.device_communicators import shm_tensor_arena
    except ImportError:  # a vLLM before 0.32: no arena to switch
        return None
    return shm_tensor_arena


PAGE = mmap.PAGESIZE
# /proc/self/pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst)
_PRESENT, _SWAPPED, _FILE_OR_SHARED = np.uint64(1 << 63), np.uint64(1 << 62), np.uint64(1 << 61)
# per reader arena: slot -> (its private mapping, the mapping's address); dropped with the arena
_PRIVATE_MAPS: weakref.WeakKeyDictionary[Any, dict[int, tuple[mmap.mmap, int]]] = weakref.WeakKeyDictionary()
_pagemap: tuple[int, int] | None = None  # (pid, fd): /proc/self is resolved at open, so a fork reopens


def _slot_mapping(arena: Any, arena_name: str, slot: int) -> tuple[mmap.mmap, int]:
    """This reader's private copy-on-write mapping of a whole slot, made at its first use and kept.

    Kept, its page table entries stay: a later message in the slot reads the pages the writer
    rewrote with no fault (they are the file's pages), where a new mapping per message faulted
    on every page (a cost of the order of a memcpy of the bytes per reader, docs/design.md)."""
    maps = _PRIVATE_MAPS.setdefault(arena, {})
    if slot not in maps:
        fd = os.open(os.path.join(SHM_DIR, arena_name.lstrip("/")), os.O_RDONLY)
        try:
            # slot_bytes (256 MiB) is a multiple of the page size, so every slot starts on a page
            mapping = mmap.mmap(fd, arena.slot_bytes, flags=mmap.MAP_PRIVATE,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=slot * arena.slot_bytes)
        finally:
            os.close(fd)
        anchor = ctypes.c_char.from_buffer(mapping)
        maps[slot] = (mapping, ctypes.addressof(anchor))
        del anchor  # the address stays valid while the mapping lives; the export must not
    return maps[slot]


def _written_pages(address: int, nbytes: int) -> np.ndarray | None:
    """Which pages of ``[address, address + nbytes)`` hold this process's own copy (a reader wrote
    there: copy-on-write made it anonymous, or it was swapped out), from /proc/self/pagemap; None
    where pagemap cannot be read."""
    global _pagemap
    try:
        if _pagemap is None or _pagemap[0] != os.getpid():
            _pagemap = (os.getpid(), os.open("/proc/self/pagemap", os.O_RDONLY))
        count = -(-nbytes // PAGE)
        raw = os.pread(_pagemap[1], count * 8, address // PAGE * 8)
    except OSError:
        return None
    if len(raw) != count * 8:
        return None
    entries = np.frombuffer(raw, dtype=np.uint64)
    return ((entries & _SWAPPED) != 0) | (((entries & _PRESENT) != 0) & ((entries & _FILE_OR_SHARED) == 0))


def discard_writes(mapping: mmap.mmap, address: int, nbytes: int) -> int:
    """Drop this reader's own copies of the pages it wrote in ``mapping[:nbytes]``, so that the
    next message in the slot reads the writer's bytes; return how many pages were dropped. Pages
    it only read are the file's and stay mapped. Without pagemap, every page is dropped (correct;
    the next message faults them in again)."""
    written = _written_pages(address, nbytes)
    if written is None:
        mapping.madvise(mmap.MADV_DONTNEED, 0, -(-nbytes // PAGE) * PAGE)
        return -(-nbytes // PAGE)
    if not written.any():
        return 0
    edges = np.flatnonzero(np.diff(np.concatenate(([0], written.view(np.int8), [0]))))
    for first, end in zip(edges[::2], edges[1::2]):  # runs of written pages
        mapping.madvise(mmap.MADV_DONTNEED, int(first) * PAGE, int(end - first) * PAGE)
    return int(written.sum())


def _release(mapping: mmap.mmap, address: int, nbytes: int, pending: list[int], slot: int) -> None:
    discard_writes(mapping, address, nbytes)  # before the slot can be written again
    pending.append(slot)


def rebuild_private(arena_name: str, slot: int, nbytes: int, dtype_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Return a writable tensor over this reader's private copy-on-write mapping of ``slot``.

    The reader's attached arena (vLLM's registry) gives the slot's place. Reads share the
    writer's pages; a write copies the page for this reader alone. Once the tensor's storage is
    freed, the pages this reader wrote are dropped from its mapping (``discard_writes``) and the
    slot is queued for release, as vLLM's own views are (the arena's ``_pending_release``,
    retired at the reader's next ``dequeue``)."""
    arena = _arena_module()._TENSOR_ARENAS[arena_name]
    dtype = getattr(torch, dtype_name)  # nbytes >= the arena's 8 MiB: never empty
    mapping, address = _slot_mapping(arena, arena_name, slot)
    holder = np.frombuffer(mapping, dtype=np.uint8, count=nbytes)
    # the storage holds ``holder`` (and ``holder`` the mapping): freed with the last view
    weakref.finalize(holder, _release, mapping, address, nbytes, arena._pending_release, slot)
    return torch.from_numpy(holder).view(dtype).view(shape)


def rebuild_private_parameter(*args: Any) -> torch.nn.Parameter:
    return torch.nn.Parameter(rebuild_private(*args), requires_grad=False)


_REBUILD = {torch.Tensor: rebuild_private, torch.nn.Parameter: rebuild_private_parameter}


def _min_bytes() -> int:
    return int(getattr(_arena_module(), "_ARENA_MIN_BYTES", 8 << 20))


class ArenaPickler(pickle.Pickler):
    """The testbed's arena pickler: the slot copy of vLLM's arena, readers' views private, claims recorded.

    Same constructor as vLLM's ``_ArenaPickler`` (upstream's ``enqueue`` builds it). Which tensors
    qualify is vLLM's rule (exact ``Tensor``/``Parameter``, CPU, strided, contiguous, no grad,
    >= ``_ARENA_MIN_BYTES``); the copy into a free slot is vLLM's ``write_tensor``, whose ``None``
    (no free slot, too large) falls through to the ordinary path."""

    def __init__(self, file: Any, arena: Any, buffer_callback: Callable[..., Any] | None = None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=buffer_callback)
        self.arena = arena
        self.min_bytes = _min_bytes()
        claims(arena).clear()

    def reducer_override(self, obj: Any) -> Any:
        rebuild = _REBUILD.get(type(obj))
        if (rebuild is None or obj.device.type != "cpu" or obj.layout != torch.strided or not obj.is_contiguous()
                or obj.requires_grad):
            return NotImplemented
        nbytes = obj.numel() * obj.element_size()
        if nbytes < self.min_bytes:
            return NotImplemented
        _prefer_warm_slot(self.arena)
        slot = self.arena.write_tensor(obj)
        if slot is None:
            return NotImplemented
        claims(self.arena).append(slot)
        _wrote(self.arena, slot)
        return rebuild, (self.arena.shared_memory.name, slot, nbytes, str(obj.dtype).removeprefix("torch."),
                         tuple(obj.shape))


def _written_order(arena: Any) -> list[int]:
    """The slots the testbed's pickler wrote on ``arena``, each once, the latest last."""
    found = getattr(arena, "_testbed_written", None)
    if found is None:
        found = arena._testbed_written = []
    return found


def _wrote(arena: Any, slot: int) -> None:
    order = _written_order(arena)
    if slot in order:  # at most the arena's 8 slots
        order.remove(slot)
    order.append(slot)


def _prefer_warm_slot(arena: Any) -> None:
    """Point vLLM's ``write_tensor`` at the free slot written most recently, whose pages are still
    in the caches: its own round robin over 8 slots of 256 MiB writes to the coldest one, and an
    8 MiB write took 1.38 ms that way against 0.78 ms alternating two slots (a memcpy: 0.73 ms,
    one thread). Free is vLLM's rule (never written, or freed by every reader); ``write_tensor``
    checks it again and probes on from there if the slot was taken meanwhile."""
    for slot in reversed(_written_order(arena)):
        with arena._meta(slot) as meta:
            if meta[0] == 0 or sum(meta[1:]) == arena.n_reader:
                arena._next_slot = slot
                return


class NoArenaPickler(pickle.Pickler):
    """``off``: the pickler an arena queue had before the arena existed (the arena is ignored)."""

    def __init__(self, file: Any, arena: Any, buffer_callback: Callable[..., Any] | None = None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=buffer_callback)


def claims(arena: Any) -> list[int]:
    """The slots the testbed's pickler claimed for the message being enqueued on ``arena``."""
    found = getattr(arena, "_testbed_claims", None)
    if found is None:
        found = arena._testbed_claims = []
    return found


def free_unpublished(mq: Any, published_before: int) -> list[int]:
    """After a failed ``enqueue``: free the slots its message claimed if the message was not
    published (the ring's write index did not move), and return them. A published message's
    slots belong to its readers."""
    arena = getattr(mq, "tensor_arena", None)
    if arena is None or mq.current_idx != published_before:
        return []
    freed = list(claims(arena))
    for slot in freed:
        with arena._meta(slot) as meta:
            meta[0] = 0  # written=0: free (what write_tensor checks first)
    claims(arena).clear()
    return freed


def slot_states(arena: Any) -> list[str]:
    """Each slot of a writer's ``arena``: ``free`` (never written, or freed by every reader) or
    ``held by readers [i, ...]`` (0-based reader ranks that have not freed it)."""
    states = []
    for slot in range(arena.n_slots):
        with arena._meta(slot) as meta:
            written, done = meta[0], list(meta[1:])
        holders = [i for i, flag in enumerate(done) if not flag]
        states.append("free" if not written or not holders else f"held by readers {holders}")
    return states


def guard(enqueue: Callable[..., None]) -> Callable[..., None]:
    """Return ``enqueue`` that frees the arena slots of a message it failed to publish (``testbed``);
    other modes get ``enqueue`` itself."""
    if _mode is not PatchMode.TESTBED or _arena_module() is None:
        return enqueue

    def guarded(self: Any, obj: Any, timeout: float | None = None) -> None:
        # max_chunks >= 2 in vLLM (10 by default): one publish always moves the index
        before = self.current_idx
        try:
            enqueue(self, obj, timeout)
        except BaseException:
            free_unpublished(self, before)
            raise

    guarded.testbed_mode = getattr(enqueue, "testbed_mode", PatchMode.UPSTREAM)  # type: ignore[attr-defined]
    guarded.testbed_arena_guard = True  # type: ignore[attr-defined]
    return guarded


def apply(mode: PatchMode) -> None:
    """Make the arena's writer behave as ``mode`` in this process (a vLLM without the arena: nothing
    to switch). ``broadcast.apply`` reads the mode to compose ``enqueue`` (``guard``): apply this first."""
    global _installed_pickler, _mode
    module = _arena_module()
    _mode = mode
    if module is None or not hasattr(module, "_ArenaPickler"):
        return
    if _installed_pickler is None:
        _installed_pickler = module._ArenaPickler
    module._ArenaPickler = {PatchMode.UPSTREAM: _installed_pickler, PatchMode.OFF: NoArenaPickler,
                            PatchMode.TESTBED: ArenaPickler}[mode]


def active_mode() -> PatchMode:
    """Return the arena mode in force in this process, read back from vLLM's module."""
    module = _arena_module()
    installed = getattr(module, "_ArenaPickler", None)
    if installed is ArenaPickler:
        return PatchMode.TESTBED
    if installed is NoArenaPickler:
        return PatchMode.OFF
    return PatchMode.UPSTREAM


def pickler_class() -> type | None:
    """The arena pickler an ``enqueue`` uses now (None: this vLLM has no arena)."""
    return getattr(_arena_module(), "_ArenaPickler", None)

"""Memory pools of the emulated CPU device graph.

A pool is a set of ``UntypedStorage`` blocks. When a capture ends, a liveness planner places the
capture's intermediates (storages produced during the capture that nothing outside the graph still
holds) into the pool's blocks: two intermediates whose lifetimes (first write .. last use, in op
order) are disjoint may share bytes. Graphs captured into one pool share its blocks, which is safe
because graphs never run concurrently: an intermediate is always rewritten by its own replay before
it is read. When an intermediate fits nowhere, a block is grown (``UntypedStorage.resize_``: the
tensors of the graphs placed in it view its storage, so they move with it, and their values need
not survive, being rewritten by every replay) rather than a new one added, when growing costs
fewer bytes: so a pool ends near the size of its largest capture whatever order the captures
come in, smallest first included. A block that no graph claims any more is freed.

The caller must guarantee what a CUDA graph pool asks for: graphs that share a pool are never
replayed at the same time (no two threads, no replay inside another replay), and no graph of a
pool is replayed by another thread while a capture into that pool ends (its blocks may move)."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence, Set
from dataclasses import dataclass, field

import torch

from npugraph_runtime.devices.base import PoolHandle

ALIGNMENT = 64  # bytes; a multiple of every dtype's size, so any placement is element-aligned


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


@dataclass(eq=False)
class Block:
    """One buffer of a pool. ``claims`` counts the graphs that placed intermediates in it."""

    storage: torch.UntypedStorage
    nbytes: int
    claims: int = 0


@dataclass(frozen=True)
class Lifetime:
    """An intermediate to place: its size and the op indices of its first write and last use."""

    nbytes: int
    first: int
    last: int


@dataclass(frozen=True)
class Placement:
    block: Block
    offset: int  # bytes into the block


@dataclass(eq=False)
class CpuPool:
    ident: int
    blocks: list[Block] = field(default_factory=list)

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def plan(self, items: Sequence[Lifetime], avoid: Set[int] = frozenset()) -> list[Placement]:
        """Place ``items`` (one capture's intermediates) and claim the blocks used; the result is in
        the order of ``items``. Largest first, each into the smallest block with a gap that no
        time-overlapping item of this capture occupies; when nothing fits, the block that needs
        the least growth to hold it at its end is grown, or a new block added if that is smaller.
        ``avoid``: addresses of blocks the capture itself reads or writes (another graph of the
        pool replayed inside it), which hold that graph's data while this one runs."""
        taken: dict[int, list[tuple[int, int, int, int]]] = {}  # id(block) -> (off, end, first, last)
        placements: list[Placement | None] = [None] * len(items)
        order = sorted(range(len(items)), key=lambda i: (-items[i].nbytes, items[i].first))
        for i in order:
            item = items[i]
            size = _aligned(max(item.nbytes, 1))
            placed = None
            for block in sorted(self.blocks, key=lambda b: b.nbytes):
                if block.nbytes < size or block.storage.data_ptr() in avoid:
                    continue
                offset = _first_gap(taken.get(id(block), []), item, size, block.nbytes)
                if offset is not None:
                    placed = Placement(block, offset)
                    break
            if placed is None:
                placed = self._grow_for(taken, item, size, avoid)
            if placed is None:
                block = Block(torch.UntypedStorage(size), size)  # type: ignore[no-untyped-call]
                self.blocks.append(block)
                placed = Placement(block, 0)
            taken.setdefault(id(placed.block), []).append(
                (placed.offset, placed.offset + size, item.first, item.last)
            )
            placements[i] = placed
        for block in self.blocks:
            if id(block) in taken:
                block.claims += 1
        return [p for p in placements if p is not None]

    def _grow_for(
        self, taken: dict[int, list[tuple[int, int, int, int]]], item: Lifetime, size: int,
        avoid: Set[int],
    ) -> Placement | None:
        """Grow the block that needs the fewest extra bytes to hold ``item`` after the last of
        this capture's time-overlapping items in it; None when a new block would be smaller."""
        best: tuple[int, Block, int] | None = None
        for block in self.blocks:
            if block.storage.data_ptr() in avoid:
                continue
            offset = max(
                (end for off, end, first, last in taken.get(id(block), [])
                 if first <= item.last and item.first <= last),
                default=0,
            )
            extra = offset + size - block.nbytes
            if extra < size and (best is None or extra < best[0]):
                best = (extra, block, offset)
        if best is None:
            return None
        extra, block, offset = best
        block.storage.resize_(block.nbytes + extra)
        block.nbytes += extra
        return Placement(block, offset)

    def release(self, blocks: Sequence[Block]) -> None:
        """Drop one graph's claims; blocks nobody claims are freed."""
        for block in {id(b): b for b in blocks}.values():
            block.claims -= 1
        self.blocks = [b for b in self.blocks if b.claims > 0]


def _first_gap(
    taken: list[tuple[int, int, int, int]], item: Lifetime, size: int, capacity: int
) -> int | None:
    busy = sorted((off, end) for off, end, first, last in taken if first <= item.last and item.first <= last)
    cursor = 0
    for off, end in busy:
        if off - cursor >= size:
            return cursor
        cursor = max(cursor, end)
    return cursor if capacity - cursor >= size else None


# Pools live as long as a graph uses them; a handle alone keeps nothing alive (it holds an int),
# so an unused handle reports 0 bytes and its pool is recreated, empty, on next use.
_POOLS: weakref.WeakValueDictionary[int, CpuPool] = weakref.WeakValueDictionary()
_IDS = itertools.count(1)
_CPU = torch.device("cpu")


def new_cpu_pool_handle() -> PoolHandle:
    return PoolHandle(_CPU, next(_IDS))


def cpu_pool(handle: PoolHandle) -> CpuPool:
    """The pool behind ``handle``, created on first use."""
    ident = int(handle.ident)
    pool = _POOLS.get(ident)
    if pool is None:
        pool = CpuPool(ident)
        _POOLS[ident] = pool
    return pool


def cpu_pool_bytes(handle: PoolHandle) -> int:
    pool = _POOLS.get(int(handle.ident))
    return 0 if pool is None else pool.nbytes()

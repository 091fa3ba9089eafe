"""How the capture manager's tensor inputs reach a capture: which memory a capture may use in
place, which writes it refuses, and how a clone_input=False buffer is refilled safely."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from npugraph_runtime._compat import TorchDispatchMode, op_base_name
from npugraph_runtime.errors import PolicyError
from npugraph_runtime.schema import write_positions
from npugraph_runtime.spans import byte_span

_data_ptr = torch.Tensor.data_ptr
_stride = torch.Tensor.stride


def storage_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s whole storage (0 for a storage of no bytes, shared by all of them)."""
    return int(t.untyped_storage().data_ptr())


class WriteWatch(TorchDispatchMode):  # type: ignore[misc]
    """Notes which of the watched storages (address -> input index) an op writes in place, by
    the op's schema, and which user buffers (``raw``: address -> input index) the graph reads
    through ``as_strided``, i.e. at absolute storage positions that may lie outside the input's
    own elements. Active while the manager captures, on every device."""

    # higher-order operators (cond, invoke_subgraph, ...) pass through unchecked rather than fail
    supports_higher_order_operators = True

    def __init__(self, watched: dict[int, int], raw: dict[int, int] | None = None,
                 on_raw_read: Callable[[int], object] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.watched = watched
        self.raw = raw or {}
        self.on_raw_read = on_raw_read  # told each raw read's input index as it happens
        self.written: dict[int, str] = {}  # input index -> the first op that wrote it
        self.raw_reads: set[int] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        try:
            positions, names = write_positions(func)
        except AttributeError:  # a higher-order operator has no schema
            return func(*args, **kwargs)
        if self.raw and args and isinstance(args[0], torch.Tensor) and (
            op_base_name(func).startswith("as_strided")
        ):
            slot = self.raw.get(storage_ptr(args[0]))
            if slot is not None:
                self.raw_reads.add(slot)
                if self.on_raw_read is not None:
                    self.on_raw_read(slot)
        if positions or names:
            targets = [args[i] for i in positions if i < len(args)] + [kwargs.get(n) for n in names]
            for t in _flat_tensors(targets):
                ptr = storage_ptr(t)
                slot = self.watched.get(ptr) if ptr else None
                if slot is not None:
                    self.written.setdefault(slot, str(func))
        return func(*args, **kwargs)


def _flat_tensors(values: Sequence[object]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found += _flat_tensors(v)
    return found


def refiller(
    buffers: Sequence[torch.Tensor],
    copy: Callable[[list[torch.Tensor], Sequence[torch.Tensor]], object],
    slots: Sequence[int],
) -> tuple[Callable[[Sequence[torch.Tensor]], bool], Callable[[Sequence[torch.Tensor]], None]]:
    """For clone_input=False: ``(unchanged, refill)``. ``unchanged(sources)`` is the hot-path test
    (every source is its buffer's exact view: same address and strides, so nothing is copied);
    ``refill(sources)`` copies each other source into its buffer (``slots``: their input indices,
    for messages). A source that shares memory with a buffer (the same tensor seen transposed)
    is read completely before any buffer is written. A buffer that is the caller's tensor and
    whose bytes this very call passes as an input (the same tensor transposed, two tensors
    swapped, overlapping windows of one tensor) is never overwritten: that raises PolicyError
    instead of changing the caller's data."""
    ptrs = list(map(_data_ptr, buffers))
    strides = list(map(_stride, buffers))
    storages = {storage_ptr(b) for b in buffers} - {0}

    def unchanged(sources: Sequence[torch.Tensor]) -> bool:
        return list(map(_data_ptr, sources)) == ptrs and list(map(_stride, sources)) == strides

    def refill(sources: Sequence[torch.Tensor]) -> None:
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        live = [byte_span(src) for src in sources]
        for slot, buf, ptr, stride, src in zip(slots, buffers, ptrs, strides, sources, strict=True):
            if src.data_ptr() == ptr and src.stride() == stride:
                continue
            lo, hi = byte_span(buf)
            if any(a < hi and lo < b for a, b in live):
                raise PolicyError(
                    f"clone_input=False: input {slot}'s capture buffer is the tensor given as "
                    f"input {slot} at capture, and this call passes its memory as an input too; "
                    f"copying the new input {slot} into it would change the caller's data. Pass "
                    "tensors that do not share memory with the first call's, or use "
                    "clone_input=True"
                )
            if storage_ptr(src) in storages:
                src = src.clone()
            dsts.append(buf)
            srcs.append(src)
        copy(dsts, srcs)

    return unchanged, refill


def mirror(x: torch.Tensor) -> torch.Tensor:
    """An owned buffer laid out in storage as ``x`` is: a copy of ``x``'s whole storage, viewed
    at ``x``'s offset with ``x``'s sizes and strides (for a graph that reads ``x`` at absolute
    storage positions, through as_strided)."""
    storage = x.untyped_storage()
    raw = torch.empty(storage.nbytes(), dtype=torch.uint8, device=x.device)
    raw.copy_(torch.empty(0, dtype=torch.uint8, device=x.device).set_(storage))
    return torch.empty(0, dtype=x.dtype, device=x.device).set_(
        raw.untyped_storage(), x.storage_offset(), x.shape, x.stride())


def mirror_filler(
    buffers: Sequence[torch.Tensor], slots: Sequence[int], name: str
) -> Callable[[Sequence[torch.Tensor]], None]:
    """Copies each source's whole storage into its mirror buffer (see ``mirror``). A source laid
    out otherwise (storage offset, strides, storage size) is refused: the graph's absolute reads
    would land elsewhere than eager's."""
    layouts = [(b.storage_offset(), b.stride(), b.untyped_storage().nbytes()) for b in buffers]
    raws = [torch.empty(0, dtype=torch.uint8, device=b.device).set_(b.untyped_storage())
            for b in buffers]

    def fill(sources: Sequence[torch.Tensor]) -> None:
        for slot, src, raw, layout in zip(slots, sources, raws, layouts, strict=True):
            storage = src.untyped_storage()
            if (src.storage_offset(), src.stride(), storage.nbytes()) != layout:
                raise PolicyError(
                    f"{name}: the graph reads input {slot} through as_strided, at absolute "
                    f"positions of its storage; it was captured for a tensor at storage offset "
                    f"{layout[0]} with strides {layout[1]} in a storage of {layout[2]} bytes, and "
                    f"this call passes offset {src.storage_offset()}, strides {src.stride()}, "
                    f"{storage.nbytes()} bytes. Pass tensors laid out like the first call's, or "
                    "call reset()"
                )
            raw.copy_(torch.empty(0, dtype=torch.uint8, device=src.device).set_(storage))

    return fill

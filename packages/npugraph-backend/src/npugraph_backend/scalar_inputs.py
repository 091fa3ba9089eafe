"""Python ints that only feed values are graph inputs, not graph keys.

Dynamo turns a Python int that changes between calls (a decode position) into a SymInt
placeholder of the AOT graph, and the runtime keys captures by the values of such inputs: a
capture per value. An int whose symbol determines no shape, stride or storage offset of any
tensor in the graph, and whose every use is an op we can restate over tensors, is a value the
replay may read from memory instead: its placeholder becomes a 0-d int64 tensor, its SymInt
arithmetic becomes tensor arithmetic, its scalar uses take the tensor (``cache[pos] = x``, a
select that only locates a write, becomes an index_put at ``[pos]``), and the compiled graph's
caller turns the int into a fresh 0-d tensor on each call (a USER input: the runtime copies it
into the capture's buffer with the other user inputs, one foreach copy). A fresh tensor rather
than one reused buffer written with ``fill_``: no state shared between threads (a clone_input=False
capture adopts its first input as its buffer, which another thread's wrapper could then be
writing during this thread's replay), at about 1 us more a call on CPU (scalar_tensor with a
device 2.6 us, fill_ 1.6 us).

Dtypes are eager's: a 0-d int64 tensor promotes with a dimensioned tensor as a Python int does;
against a 0-d integer or bool tensor it would not, so there it is first cast to the dtype a Python
int would take. Every rewritten node's dtype is checked against the one it replaces; an int
with any use outside these rules stays a key, and the log (``TORCH_LOGS=+npugraph_ex``) names why
and the user's source line."""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from npugraph_runtime import InputSpec, SlotKind

from npugraph_backend import _compat
from npugraph_backend.logs import log

aten = torch.ops.aten
VALUE_DTYPE = torch.int64

# SymInt arithmetic -> the tensor ops computing the same int (Python's floor division and
# modulo), with a tensor and with a number as the right operand (None: the number is made a tensor)
_SYM_ARITH: dict[Any, tuple[Any, Any, dict[str, object]]] = {
    torch.sym_min: (aten.minimum.default, None, {}),
    torch.sym_max: (aten.maximum.default, None, {}),
    operator.add: (aten.add.Tensor, aten.add.Scalar, {}),
    operator.sub: (aten.sub.Tensor, aten.sub.Scalar, {}),
    operator.mul: (aten.mul.Tensor, aten.mul.Scalar, {}),
    operator.floordiv: (aten.div.Tensor_mode, aten.div.Scalar_mode, {"rounding_mode": "floor"}),
    operator.mod: (aten.remainder.Tensor, aten.remainder.Scalar, {}),
}

# elementwise ops taking the int as their second operand: overload with a Scalar -> with a Tensor
_SCALAR_TO_TENSOR = {"Scalar": "Tensor", "Tensor": "Tensor", "Tensor_Scalar": "Tensor_Tensor",
                     "Scalar_mode": "Tensor_mode", "Tensor_mode": "Tensor_mode",
                     "default": "default"}
_BINARY = frozenset({
    "add", "sub", "mul", "div", "remainder", "fmod", "eq", "ne", "lt", "le", "gt", "ge",
    "bitwise_and", "bitwise_or", "bitwise_xor", "pow", "rsub", "floor_divide", "fill",
})


class _Keep(Exception):
    """The int stays a key; the message says why (logged with the node's source line)."""

    def __init__(self, why: str, node: torch.fx.Node) -> None:
        super().__init__(why)
        self.why = why
        self.node = node


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _write_destination(node: torch.fx.Node) -> bool:
    """``select(base, dim, i)`` used only as what functionalization copies a write into
    (``copy(select, src)``, then ``select_scatter``): its offset locates a write, and no tensor the
    graph computes with is read through it."""
    return node.target is aten.select.int and bool(node.users) and all(
        u.target is aten.copy.default and u.args[0] is node and node not in u.args[1:]
        for u in node.users)


def _layout_symbols(gm: torch.fx.GraphModule) -> dict[object, torch.fx.Node]:
    """symbol -> the first node with a tensor whose sizes, strides or storage offset use it
    (a write destination aside: it is restated as an index_put)."""
    first: dict[object, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if _write_destination(node):
            continue
        for t in _tensors(node.meta.get("val")):
            for s in _compat.layout_symbols(t):
                first.setdefault(s, node)
    return first


def _what(node: torch.fx.Node) -> str:
    return str(node.target) if node.op == "call_function" else node.op


class _Lifter:
    """Rewrites the uses of one int placeholder; nothing in the graph changes until ``commit``."""

    def __init__(self, gm: torch.fx.GraphModule, ph: torch.fx.Node, device: torch.device,
                 fake_mode: Any) -> None:
        self.graph = gm.graph
        self.ph = ph
        self.device = device
        self.fake_mode = fake_mode
        with fake_mode:
            value = torch.empty((), dtype=VALUE_DTYPE, device=device)
        self.value = value
        self.tensor_of: dict[torch.fx.Node, torch.fx.Node] = {ph: ph}  # derived int -> its tensor
        self.vals: dict[torch.fx.Node, Any] = {ph: value}
        self.created: list[torch.fx.Node] = []
        self.replaced: list[tuple[torch.fx.Node, torch.fx.Node]] = []
        self.dead: list[torch.fx.Node] = []

    # ---- building ----
    def _val(self, a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return self.vals.get(a, a.meta.get("val"))
        return a

    def _emit(self, before: torch.fx.Node, target: Any, args: tuple[Any, ...],
              kwargs: dict[str, Any] | None = None) -> torch.fx.Node:
        kwargs = kwargs or {}
        with self.graph.inserting_before(before):
            node = self.graph.call_function(target, args, kwargs)
        node.meta["stack_trace"] = before.meta.get("stack_trace")
        self.created.append(node)
        val_args = torch.fx.node.map_aggregate(args, self._val)
        val_kwargs = torch.fx.node.map_aggregate(kwargs, self._val)
        try:
            with self.fake_mode:
                self.vals[node] = node.meta["val"] = target(*val_args, **val_kwargs)
        except Exception as exc:  # a restatement torch refuses: the int stays a key
            raise _Keep(f"{target} over a tensor fails ({type(exc).__name__}: {exc})",
                        before) from exc
        return node

    def _as_tensor(self, a: object, before: torch.fx.Node) -> torch.fx.Node:
        if isinstance(a, torch.fx.Node) and a in self.tensor_of:
            return self.tensor_of[a]
        return self._emit(before, aten.scalar_tensor.default, (a,),
                          {"dtype": VALUE_DTYPE, "device": self.device})

    def run(self) -> None:
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        pending = sorted(self.ph.users, key=order.__getitem__)
        seen: set[torch.fx.Node] = set()
        while pending:
            user = pending.pop(0)
            if user in seen:
                continue
            seen.add(user)
            if user.target in _SYM_ARITH and isinstance(user.meta.get("val"), torch.SymInt):
                self._arith(user)
                pending = sorted({*pending, *user.users}, key=order.__getitem__)
            else:
                self._use(user)
            self.dead.append(user)

    def _arith(self, node: torch.fx.Node) -> None:
        if node.kwargs or len(node.args) != 2:
            raise _Keep(f"it feeds {_what(node)} with arguments we do not restate", node)
        with_tensor, with_number, kwargs = _SYM_ARITH[node.target]
        a, b = node.args
        lhs = self._as_tensor(a, node)
        if (isinstance(b, torch.fx.Node) and b in self.tensor_of) or with_number is None:
            rhs = self._as_tensor(b, node)
            self.tensor_of[node] = self._emit(node, with_tensor, (lhs, rhs), kwargs)
        else:
            self.tensor_of[node] = self._emit(node, with_number, (lhs, b), kwargs)

    def _use(self, node: torch.fx.Node) -> None:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            what = "is returned as an int" if node.op == "output" else f"feeds {_what(node)}"
            raise _Keep(f"it {what}", node)
        name = node.target.overloadpacket.__name__
        overload = node.target._overloadname
        if name == "scalar_tensor":
            new = self._scalar_tensor(node)
        elif name == "arange" and overload in ("start", "start_step"):
            new = self._arange(node)
        elif name == "select" and overload == "int":
            self._select_destination(node)
            return
        elif name == "select_scatter" and overload == "default":
            new = self._select_scatter(node)
        elif name == "full" and overload == "default":
            new = self._full(node)
        elif name == "masked_fill" and overload == "Scalar":
            new = self._second_operand(node, aten.masked_fill.Tensor, index=2, of=0)
        elif name in _BINARY and overload in _SCALAR_TO_TENSOR:
            packet = node.target.overloadpacket
            target = getattr(packet, _SCALAR_TO_TENSOR[overload], None)
            if target is None:
                raise _Keep(f"it feeds {node.target}, which has no Tensor overload", node)
            new = self._second_operand(node, target, index=1, of=0)
        else:
            raise _Keep(f"it feeds {node.target}, an op not restated over a tensor", node)
        expected = node.meta.get("val")
        got = self.vals[new]
        if not (isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor)
                and got.dtype == expected.dtype and got.dim() == expected.dim()):
            raise _Keep(f"over a tensor, {node.target} would give {getattr(got, 'dtype', got)} "
                        f"where eager gives {getattr(expected, 'dtype', expected)}", node)
        self.replaced.append((node, new))

    def _operand(self, node: torch.fx.Node, index: int) -> torch.fx.Node:
        arg = node.args[index] if index < len(node.args) else None
        if not isinstance(arg, torch.fx.Node) or arg not in self.tensor_of:
            raise _Keep(f"it is not the scalar operand of {node.target}", node)
        return self.tensor_of[arg]

    def _second_operand(self, node: torch.fx.Node, target: Any, index: int, of: int) -> torch.fx.Node:
        others = [a for i, a in enumerate(node.args) if i != index] + list(node.kwargs.values())
        if any(isinstance(a, torch.fx.Node) and a in self.tensor_of for a in others):
            raise _Keep(f"it is not only the scalar operand of {node.target}", node)
        value = self._operand(node, index)
        tensor = self._val(node.args[of])
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 0:
            # 0-d against 0-d: the int64 tensor would win where a Python int does not
            want = torch.result_type(tensor, 1)
            if want != VALUE_DTYPE and not want.is_floating_point and not want.is_complex:
                value = self._emit(node, aten._to_copy.default, (value,), {"dtype": want})
        args = tuple(value if i == index else a for i, a in enumerate(node.args))
        return self._emit(node, target, args, dict(node.kwargs))

    def _scalar_tensor(self, node: torch.fx.Node) -> torch.fx.Node:
        value = self._operand(node, 0)
        expected = node.meta["val"]
        # a copy, never the input itself: the graph may write or return it
        return self._emit(node, aten._to_copy.default, (value,),
                          {"dtype": expected.dtype, "device": expected.device})

    def _select_destination(self, node: torch.fx.Node) -> None:
        """Each ``copy(select(base, dim, i), src)`` is ``src`` broadcast to the selected shape."""
        self._operand(node, 2)
        if not _write_destination(node) or node.args[0] in self.tensor_of:
            raise _Keep(f"it is the offset of a view {node.target} that is read", node)
        shape = list(node.meta["val"].shape)
        for copy in list(node.users):
            src = copy.args[1]
            expected = copy.meta["val"]
            if not isinstance(src, torch.fx.Node) or self._val(src).device != expected.device:
                raise _Keep(f"it locates a {copy.target} from another device", copy)
            if self._val(src).dtype != expected.dtype:
                src = self._emit(copy, aten._to_copy.default, (src,), {"dtype": expected.dtype})
            wide = self._emit(copy, aten.expand.default, (src, shape))
            new = self._emit(copy, aten.clone.default, (wide,),
                             {"memory_format": torch.contiguous_format})
            self.replaced.append((copy, new))
            self.dead.append(copy)

    def _select_scatter(self, node: torch.fx.Node) -> torch.fx.Node:
        """``select_scatter(base, src, dim, i)`` is ``index_put(base, [:, ..., [i]], src[.., None])``."""
        base, src, dim = node.args[0], node.args[1], node.args[2]
        index = self._operand(node, 3)
        if base in self.tensor_of or src in self.tensor_of or not isinstance(dim, int):
            raise _Keep(f"it is not only the index of {node.target}", node)
        dim = dim % self._val(base).dim()
        rows = self._emit(node, aten.unsqueeze.default, (index, 0))
        values = self._emit(node, aten.unsqueeze.default, (src, dim))
        return self._emit(node, aten.index_put.default, (base, [None] * dim + [rows], values))

    def _full(self, node: torch.fx.Node) -> torch.fx.Node:
        size = node.args[0]
        if isinstance(size, torch.fx.Node) or any(
                isinstance(d, torch.fx.Node) and d in self.tensor_of for d in size):  # type: ignore[union-attr]
            raise _Keep(f"it is a size of {node.target}", node)
        value = self._operand(node, 1)
        expected = node.meta["val"]
        value = self._emit(node, aten._to_copy.default, (value,),
                           {"dtype": expected.dtype, "device": expected.device})
        wide = self._emit(node, aten.expand.default, (value, size))
        return self._emit(node, aten.clone.default, (wide,),
                          {"memory_format": torch.contiguous_format})

    def _arange(self, node: torch.fx.Node) -> torch.fx.Node:
        start = self._operand(node, 0)
        step = node.args[2] if len(node.args) > 2 else 1
        expected = node.meta["val"]
        length = expected.shape[0]
        if not isinstance(step, int) or isinstance(step, bool) or not isinstance(length, int):
            raise _Keep(f"it starts {node.target} with a step or length that is not an int", node)
        base = self._emit(node, aten.arange.start_step, (0, length * step, step),
                          {"dtype": VALUE_DTYPE, "device": expected.device})
        out = self._emit(node, aten.add.Tensor, (base, start))
        if expected.dtype != VALUE_DTYPE:
            out = self._emit(node, aten._to_copy.default, (out,), {"dtype": expected.dtype})
        return out

    # ---- the outcome ----
    def commit(self) -> None:
        for old, new in self.replaced:
            old.replace_all_uses_with(new)
        for node in reversed(self.dead):
            if not node.users:
                self.graph.erase_node(node)
        self.ph.meta["val"] = self.value

    def abandon(self) -> None:
        for node in reversed(self.created):
            self.graph.erase_node(node)


def lift_value_ints(gm: torch.fx.GraphModule, device: torch.device, name: str) -> tuple[int, ...]:
    """Rewrites ``gm`` so that each int placeholder that only feeds values takes a 0-d int64
    tensor; returns their positions (the caller passes ``torch.scalar_tensor(value)`` there)."""
    # the passes package is imported by a compile only (a warm start calls the wrapper alone)
    from npugraph_passes.lint import user_source_line

    placeholders = _compat.placeholders(gm)
    candidates = [(i, ph) for i, ph in enumerate(placeholders)
                  if _compat.symint_symbol(ph.meta.get("val")) is not None]
    if not candidates:
        return ()
    fake_mode = _compat.fake_mode_of([n.meta.get("val") for n in gm.graph.nodes])
    layout = _layout_symbols(gm)
    lifted: list[int] = []
    for slot, ph in candidates:
        symbol = _compat.symint_symbol(ph.meta["val"])
        where = layout.get(symbol)
        lifter = _Lifter(gm, ph, device, fake_mode) if fake_mode is not None else None
        try:
            if where is not None:
                raise _Keep(f"it determines the shape or view offset of {_what(where)}", where)
            if lifter is None:
                raise _Keep("the graph carries no fake values to check a rewrite with", ph)
            lifter.run()
        except _Keep as keep:
            if lifter is not None:
                lifter.abandon()
            # a tensor input's size is a key by nature: said at debug level only
            level = logging.DEBUG if keep.node.op == "placeholder" else logging.INFO
            log.log(level, "%s: int input %s (%s) stays in the graph key, a capture per value: "
                    "%s, at %s", name, ph.name, symbol, keep.why,
                    user_source_line(keep.node) or "(no source line)")
            continue
        lifter.commit()
        lifted.append(slot)
        log.debug("%s: int input %s (%s) is passed as a 0-d tensor, not keyed", name, ph.name,
                  symbol)
    if lifted:
        gm.graph.lint()
    return tuple(lifted)


def as_value_inputs(spec: InputSpec, slots: Sequence[int]) -> InputSpec:
    """``spec`` with ``slots`` as user tensors of fixed shape (never in the key)."""
    kinds = list(spec.kinds)
    keyed: list[tuple[int, ...] | None] = (
        list(spec.keyed_dims) if spec.keyed_dims else [None] * len(kinds))
    for i in slots:
        kinds[i] = SlotKind.USER
        keyed[i] = ()
    return InputSpec(tuple(kinds), tuple(keyed))


def passing_ints_as_tensors(
    fn: Callable[..., Any], slots: Sequence[int], device: torch.device
) -> Callable[..., Any]:
    """``fn`` called with the ints at ``slots`` as fresh 0-d int64 tensors on ``device``."""
    make = torch.scalar_tensor
    if len(slots) == 1:
        (i,) = slots

        def one(*args: Any) -> Any:
            call = list(args)
            call[i] = make(call[i], dtype=VALUE_DTYPE, device=device)
            return fn(*call)

        return one
    chosen = frozenset(slots)

    def many(*args: Any) -> Any:
        return fn(*(make(a, dtype=VALUE_DTYPE, device=device) if i in chosen else a
                    for i, a in enumerate(args)))

    return many

"""Whether a graph with dynamic shapes may be padded to a capture size, decided on its FX graph.

The padded symbols are the batch: symbolic sizes that are the leading dim of every input tensor
they size; such a symbol is padded wherever it appears. A call of size v padded to t runs
the graph as a function of t; it returns the rows a call of size v returns, and leaves the same
state, if every real element (all padded-dim indices below v) of every value depends on real
elements only. Each op keeps that if it never reduces, contracts, sorts, scans, selects, slices
or concatenates along a padded dim, never uses a padded size as a value, and reshapes a padded
dim only as the outermost factor of what it merges or splits. A write whose destination does not
carry the padded dim (a KV cache) but whose index does would land the padded rows in real rows
of the destination: it is shown safe only when one of its indices is a padded input the user
gave a pad value (``pad_values``, a scratch row). Anything else is refused, naming the op, the
input and the user's source line; the result is a plain, picklable ``PaddingPlan``."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx
from npugraph_runtime import InputSpec, OutputSpec, SlotKind

from npugraph_backend import _compat
from npugraph_backend.config import CompilerConfig, OptionError, resolved_capture_sizes
from npugraph_backend.logs import log
from npugraph_backend.padding_plan import ArgumentNames, PaddedInput, PaddingPlan
from npugraph_backend.specs import GraphSpecs


class PaddingRefused(ValueError):
    """capture_sizes / pad_values cannot be applied to this graph; the message says which op or
    input, and the user's source line."""


# ops that move, view or convert elements one to one, whatever their dims
_MOVES = {
    "permute", "transpose", "t", "unsqueeze", "squeeze", "clone", "contiguous", "alias", "detach",
    "_to_copy", "lift_fresh_copy", "expand", "copy", "stack", "numpy_T", "view_as_real",
    "view_as_complex", "expand_copy", "permute_copy", "unsqueeze_copy", "squeeze_copy",
    "transpose_copy", "t_copy", "_conj", "fill", "zeros_like", "ones_like",
    "empty_like", "full_like", "masked_fill", "where", "resolve_conj", "resolve_neg",
}
_RESHAPES = {"view", "_unsafe_view", "reshape", "view_copy"}
# ops whose ``dim`` argument must not be a padded dim (they pick, cut or join along it)
_ALONG_DIM = {
    "select", "split", "split_with_sizes", "chunk", "unbind", "narrow", "cat", "index_select",
    "gather", "select_scatter", "slice_scatter", "unsafe_split", "unsafe_chunk",
    "split_with_sizes_copy", "unbind_copy", "select_copy", "diagonal",
}
# reductions, scans, sorts: ``dim`` (None or empty: every dim) must not be a padded dim
_REDUCTIONS = {
    "sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "prod", "var", "std",
    "var_mean", "std_mean", "logsumexp", "_softmax", "_log_softmax", "softmax", "log_softmax",
    "_safe_softmax", "cumsum", "cumprod", "cummax", "cummin", "sort", "topk", "linalg_vector_norm",
    "any", "all", "norm", "median", "mode", "kthvalue", "count_nonzero", "nansum", "aminmax",
    "flip", "roll", "logcumsumexp",
}
_CREATIONS = {
    "arange", "full", "zeros", "ones", "empty", "empty_strided", "new_zeros", "new_ones",
    "new_empty", "new_full", "scalar_tensor", "randn", "rand",
}
_SCATTERS = {
    "index_put", "index_put_", "_unsafe_index_put", "index_copy", "index_copy_", "scatter",
    "scatter_", "index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce",
    "scatter_reduce_", "index_fill", "index_fill_", "_index_put_impl_", "_index_put_impl",
}
# arguments where a padded size may appear: it is a size, not a value (a slice's or arange's
# end, a narrow's length: the first rows stay the same rows; not a split size, whose later
# chunks would start elsewhere)
_SIZE_ARGS = {"size", "end", "length", "shape"}
# ops through which an index keeps its values (a scratch row stays the scratch row)
_KEEPS_VALUES = _MOVES - {"fill", "zeros_like", "ones_like", "empty_like", "full_like",
                          "masked_fill", "where"} | _RESHAPES | {"slice"}
_MATMUL_OPERANDS = {
    "mm": ("self", "mat2"), "addmm": ("mat1", "mat2"), "bmm": ("self", "mat2"),
    "baddbmm": ("batch1", "batch2"), "addbmm": ("batch1", "batch2"), "matmul": ("self", "other"),
    "mv": ("self", "vec"), "addmv": ("mat", "vec"), "dot": ("self", "tensor"),
}
# a part of its first argument (a message names the input it is part of)
_VIEWS_OF = {"select", "narrow", "diagonal", "as_strided"}
_MAX_INT64 = 2**63 - 1


def where(node: torch.fx.Node) -> str:
    """The user's source line of a node (the last frame of its recorded stack trace; a node
    AOT's decompositions made without one: the line of a neighbour)."""
    trace = node.meta.get("stack_trace")
    for other in (*node.users, *node.all_input_nodes):
        if trace:
            break
        trace = other.meta.get("stack_trace")
    if not isinstance(trace, str) or not trace.strip():
        return "no source line recorded"
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    frames = [i for i, line in enumerate(lines) if line.startswith("File ")]
    if not frames:
        return lines[-1]
    last = frames[-1]
    code = lines[last + 1] if last + 1 < len(lines) else ""
    return f"{lines[last]}: {code}" if code else lines[last]


def _op_name(node: torch.fx.Node) -> str:
    schema = _compat.op_schema(node) if node.op == "call_function" else None
    if schema is not None:
        return str(schema.name).split("::")[-1]
    return str(getattr(node.target, "__name__", node.target))


def _val(arg: object) -> Any:
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg


class _Graph:
    """The padded dims of every value of one graph, and the checks of each op."""

    def __init__(self, symbols: set[Any], names: Mapping[str, str], labels: Mapping[str, str],
                 pads: Mapping[str, object]):
        self.symbols = symbols
        self.names = names  # placeholder name -> forward argument name
        self.labels = labels  # placeholder name -> the user's name of it (L['self'].kc)
        self.pads = pads  # placeholder name -> pad value

    def has_symbol(self, size: object) -> bool:
        expr = _compat.sym_expr(size)
        return expr is not None and bool(expr.free_symbols & self.symbols)

    def pdims(self, arg: object) -> tuple[int, ...]:
        value = _val(arg)
        if not isinstance(value, torch.Tensor):
            return ()
        return tuple(d for d, size in enumerate(value.shape) if self.has_symbol(size))

    def refuse(self, node: torch.fx.Node, why: str) -> PaddingRefused:
        return PaddingRefused(
            f"npugraph_ex capture_sizes: cannot pad op aten.{_op_name(node)} ({node.name}): {why}; "
            f"at {where(node)}. Padding is used only where it cannot change a real row; compile "
            "without capture_sizes (one capture per size) or change the model"
        )

    def input_of(self, arg: object) -> str:
        """The forward argument a tensor comes from, as a message says it."""
        root = self.index_root(arg, _KEEPS_VALUES | _VIEWS_OF)
        if root is not None:
            name = self.names.get(root.name)
            return f"input {name!r}" if name else f"input {self.labels.get(root.name, root.name)}"
        return f"{arg.name if isinstance(arg, torch.fx.Node) else arg!r} (computed in the graph)"

    def index_root(self, arg: object, through: frozenset[str] | set[str] = frozenset()
                   ) -> torch.fx.Node | None:
        """The placeholder an index is, through ops that keep its values (None: computed)."""
        through = through or _KEEPS_VALUES
        while isinstance(arg, torch.fx.Node):
            if arg.op == "placeholder":
                return arg
            if arg.op != "call_function" or _op_name(arg) not in through or not arg.args:
                return None
            arg = arg.args[0]
        return None

    # --- the checks -----------------------------------------------------------------------
    def check(self, node: torch.fx.Node) -> None:
        if node.op != "call_function" or node.target is operator.getitem:
            return
        schema = _compat.op_schema(node)
        if schema is None:
            return  # SymInt arithmetic: it carries no rows
        name = _op_name(node)
        bound = _bind(node, schema)
        self._check_size_uses(node, name, bound)
        tensors = [a for v in bound.values() for a in (v if isinstance(v, list | tuple) else [v])
                   if isinstance(_val(a), torch.Tensor)]
        if not any(self.pdims(a) for a in tensors):
            return
        rank = {id(a): _val(a).dim() for a in tensors}
        if name in _SCATTERS:
            self._check_scatter(node, name, bound)
        elif torch.Tag.pointwise in getattr(node.target, "tags", ()) or name in _MOVES:
            return
        elif name in _RESHAPES:
            self._check_reshape(node, bound)
        elif name == "slice":
            self._check_slice(node, bound)
        elif name in _ALONG_DIM:
            dim = bound.get("dim", 0)
            for a in tensors:
                if isinstance(dim, int) and _norm(dim, rank[id(a)]) in self.pdims(a):
                    raise self.refuse(node, f"it works along dim {dim}, the padded dim of "
                                            f"{self.input_of(a)}")
        elif name in _REDUCTIONS:
            self._check_reduction(node, bound)
        elif name == "native_layer_norm":
            x = bound["input"]
            n = len(bound["normalized_shape"])
            self._refuse_dims(node, x, range(_val(x).dim() - n, _val(x).dim()), "normalizes over")
        elif name in _MATMUL_OPERANDS:
            self._check_matmul(node, name, bound)
        elif "scaled_dot_product" in name:
            self._refuse_dims(node, bound["query"], [-1], "contracts")
            self._refuse_dims(node, bound["key"], [-2, -1], "contracts")
            self._refuse_dims(node, bound["value"], [-2], "contracts")
        elif name == "embedding":
            self._refuse_dims(node, bound["weight"], range(_val(bound["weight"]).dim()),
                              "looks up rows of")
        elif name == "index":
            self._check_index(node, bound)
        elif name == "copy_":
            dst, src = bound["self"], bound["src"]
            if self.pdims(src) and not self.pdims(dst):
                raise self.refuse(node, f"it copies rows of the padded dim into "
                                        f"{self.input_of(dst)}, which does not have it")
        else:
            raise self.refuse(node, "there is no padding rule for this op, so it cannot be shown "
                                    "to keep the padded rows apart from the real ones")

    def _check_size_uses(self, node: torch.fx.Node, name: str, bound: dict[str, Any]) -> None:
        for arg, value in bound.items():
            values = value if isinstance(value, list | tuple) else [value]
            if not any(not isinstance(_val(v), torch.Tensor) and self.has_symbol(_val(v))
                       for v in values):
                continue
            if arg in _SIZE_ARGS and (name in _RESHAPES | _CREATIONS | {"expand", "slice",
                                                                         "narrow"}
                                      or name.startswith("new_")):
                continue
            raise self.refuse(node, f"its argument {arg!r} uses the padded size as a value, which "
                                    "a padded call changes")

    def _refuse_dims(self, node: torch.fx.Node, x: object, dims: Any, verb: str) -> None:
        rank = _val(x).dim()
        bad = sorted(set(_norm(d, rank) for d in dims) & set(self.pdims(x)))
        if bad:
            raise self.refuse(node, f"it {verb} dim {bad[0]} of {self.input_of(x)}, the padded dim")

    def _check_reduction(self, node: torch.fx.Node, bound: dict[str, Any]) -> None:
        x = bound.get("self", bound.get("input"))
        dims = bound.get("dim")
        rank = _val(x).dim()
        if dims is None or dims == []:
            dims = range(rank)
        elif isinstance(dims, int):
            dims = [dims]
        self._refuse_dims(node, x, dims, "reduces, sorts or scans over")

    def _check_matmul(self, node: torch.fx.Node, name: str, bound: dict[str, Any]) -> None:
        # (left, right) operands; addmm's & co.'s "self" is the added term, pointwise
        left_name, right_name = _MATMUL_OPERANDS[name]
        left, right = bound[left_name], bound[right_name]
        self._refuse_dims(node, left, [-1], "contracts")
        self._refuse_dims(node, right, [0 if _val(right).dim() == 1 else -2], "contracts")
        if name == "addbmm":
            self._refuse_dims(node, left, [0], "sums over")

    def _check_slice(self, node: torch.fx.Node, bound: dict[str, Any]) -> None:
        x = bound["self"]
        dim = _norm(bound.get("dim", 0), _val(x).dim())
        if dim not in self.pdims(x):
            return
        start, end, step = bound.get("start"), bound.get("end"), bound.get("step", 1)
        size = _val(x).shape[dim]
        whole_end = end is None or _val(end) == _MAX_INT64 or _same(_val(end), size)
        if start in (None, 0) and step == 1 and whole_end:
            return
        raise self.refuse(node, f"it slices the padded dim {dim} of {self.input_of(x)}")

    def _check_reshape(self, node: torch.fx.Node, bound: dict[str, Any]) -> None:
        x = bound["self"]
        before = list(_val(x).shape)
        after = list(_val(node).shape)
        pin = self.pdims(x)
        pout = self.pdims(node)
        if len(pin) != 1 or len(pout) != 1:
            if pin or pout:
                raise self.refuse(node, f"it reshapes {self.input_of(x)} with "
                                        f"{len(pin)} padded dims into {len(pout)}")
            return
        outer_in = _product(before[: pin[0]])
        outer_out = _product(after[: pout[0]])
        factor = _compat.sym_expr(after[pout[0]])
        symbol = next(iter(factor.free_symbols & self.symbols)) if factor is not None else None
        ok = _same(outer_in, outer_out) and symbol is not None and bool(
            (factor / symbol).is_integer) and not ((factor / symbol).free_symbols & self.symbols)
        if not ok:
            raise self.refuse(node, f"it reshapes {self.input_of(x)} from {tuple(before)} to "
                                    f"{tuple(after)}, which mixes the padded rows with real ones")

    def _check_index(self, node: torch.fx.Node, bound: dict[str, Any]) -> None:
        x = bound["self"]
        rank = _val(x).dim()
        indexed = [d for d, i in enumerate(bound["indices"]) if i is not None and d < rank]
        self._refuse_dims(node, x, indexed, "gathers along")

    def _check_scatter(self, node: torch.fx.Node, name: str, bound: dict[str, Any]) -> None:
        base = bound["self"]
        rank = _val(base).dim()
        if "indices" in bound:
            indices = [i for i in bound["indices"] if i is not None]
            indexed = [d for d, i in enumerate(bound["indices"]) if i is not None]
        else:
            indices = [bound["index"]]
            indexed = [_norm(bound["dim"], rank)]
        self._refuse_dims(node, base, indexed, "writes along")
        padded = [i for i in indices if self.pdims(i)]
        if not padded:
            if self.pdims(base):
                return  # a row-wise write into a padded value
            raise self.refuse(node, "it writes values of the padded dim at indices that do not "
                                    "have it")
        if self.pdims(base):
            raise self.refuse(node, "it writes into a value with the padded dim at indices that "
                                    "have it too")
        for index, dim in zip(indices, indexed, strict=True):
            root = self.index_root(index) if self.pdims(index) else None
            if root is not None and root.name in self.pads:
                size = _val(base).shape[dim]
                pad = self.pads[root.name]
                if isinstance(size, int) and not (isinstance(pad, int) and -size <= pad < size):
                    raise self.refuse(node, f"the pad value {pad!r} of "
                                            f"{self.input_of(index)} is not a row of dim {dim} "
                                            f"of {self.input_of(base)} (size {size})")
                return
        named = [self.names.get(r.name) for r in map(self.index_root, padded) if r is not None]
        hint = (f"declare a scratch row for it, e.g. pad_values={{{named[0]!r}: <scratch row>}}"
                if named and named[0] else
                "index it with a forward argument given a pad value (a scratch row) in "
                "pad_values")
        raise self.refuse(node, f"it writes into {self.input_of(base)} at rows indexed by "
                                f"{self.input_of(padded[0])}, which has no pad value: padded rows "
                                f"would overwrite real ones; {hint}")


def _bind(node: torch.fx.Node, schema: Any) -> dict[str, Any]:
    bound: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _fits(pad: object, dtype: torch.dtype) -> str | None:
    """None when ``fill_`` stores ``pad`` unchanged in a tensor of ``dtype``, else what is
    allowed."""
    if dtype == torch.bool:
        return None if isinstance(pad, bool) else "True or False"
    if dtype.is_floating_point or dtype.is_complex:
        return None
    info = torch.iinfo(dtype)
    ok = isinstance(pad, int) and not isinstance(pad, bool) and info.min <= pad <= info.max
    return None if ok else f"an int in [{info.min}, {info.max}]"


def _norm(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _product(sizes: Sequence[object]) -> object:
    out: object = 1
    for s in sizes:
        out = out * s  # type: ignore[operator]
    return out


def _same(a: object, b: object) -> bool:
    ea: Any = _compat.sym_expr(a) if isinstance(a, torch.SymInt) else a
    eb: Any = _compat.sym_expr(b) if isinstance(b, torch.SymInt) else b
    if ea is None or eb is None:
        return False
    try:
        difference = ea - eb
        return bool(difference == 0) or bool(getattr(difference, "simplify", lambda: 1)() == 0)
    except TypeError:
        return False


def _batch_symbols(nodes: Sequence[torch.fx.Node], inputs: InputSpec
                   ) -> tuple[list[Any], list[tuple[int, int | None]]]:
    """The batch: a symbolic size that is the leading dim of every input tensor it sizes (a
    size that is also an inner dim somewhere, a hidden size a weight shares, is not a batch).
    Other symbolic dims (dynamic=True makes every dim one) keep one capture per size."""
    symbols: list[Any] = []
    locate: list[tuple[int, int | None]] = []
    inner: set[Any] = set()
    for slot, node in enumerate(nodes):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or not value.dim():
            continue
        for size in value.shape[1:]:
            expr = _compat.sym_expr(size)
            inner |= expr.free_symbols if expr is not None else set()
        expr = _compat.sym_expr(value.shape[0])
        if (inputs.kinds[slot] in (SlotKind.USER, SlotKind.MUTATED) and expr is not None
                and expr.is_Symbol and expr not in symbols):
            symbols.append(expr)
            locate.append((slot, 0))
    kept = [i for i, s in enumerate(symbols) if s not in inner]
    return [symbols[i] for i in kept], [locate[i] for i in kept]


def plan_padding(
    gm: torch.fx.GraphModule,
    inputs: InputSpec,
    outputs: OutputSpec,
    sizes: tuple[int, ...],
    pad_values: Mapping[str, int | float | bool] | None,
    arguments: ArgumentNames | None,
) -> PaddingPlan | None:
    """The padding of ``gm`` (an AOT inference graph, before passes), None when it has no
    symbolic input size; raises PaddingRefused where padding cannot be shown safe."""
    nodes = _compat.placeholders(gm)
    # placeholder -> forward argument name, through AOT's descriptors and Dynamo's sources
    input_names = arguments.inputs if arguments is not None else None
    argument_names = arguments.arguments if arguments is not None else None
    names: dict[str, str] = {}
    labels: dict[str, str] = {}
    for node in nodes:
        origin, flat = _compat.input_origin(node)
        if origin == "plain" and flat is not None and arguments is not None:
            name = arguments.inputs[flat] if flat < len(arguments.inputs) else None
            if name:
                names[node.name] = name
            label = arguments.labels[flat] if flat < len(arguments.labels) else None
            if label:
                labels[node.name] = label
    pad_values = dict(pad_values or {})
    if pad_values:
        allowed = sorted(argument_names or set(names.values()))
        unknown = sorted(set(pad_values) - set(allowed)) if input_names is not None else sorted(
            pad_values)
        if unknown:
            raise PaddingRefused(
                f"option 'pad_values': key {unknown[0]!r} is not allowed; allowed: the names of "
                f"the forward's arguments that reach this graph: {', '.join(allowed) or 'none'}"
                + ("" if input_names is not None else
                   " (compile_fx cannot see argument names: use torch.compile)"))

    symbols, locate = _batch_symbols(nodes, inputs)
    if not symbols:
        return None
    graph = _Graph(set(symbols), names, labels, {
        n: v for n, v in ((p, pad_values.get(a)) for p, a in names.items()) if v is not None})

    padded_inputs: list[PaddedInput] = []
    int_slots: list[tuple[int, int]] = []
    for slot, node in enumerate(nodes):
        value = node.meta.get("val")
        expr = _compat.sym_expr(value)
        if expr is not None and expr.free_symbols & graph.symbols:
            if expr not in symbols:
                raise PaddingRefused(f"npugraph_ex capture_sizes: input {node.name} is the size "
                                     f"expression {expr}, which padding cannot rewrite")
            int_slots.append((slot, symbols.index(expr)))
            continue
        dims = graph.pdims(node)
        if not dims or not isinstance(value, torch.Tensor):
            continue
        if inputs.kinds[slot] not in (SlotKind.USER, SlotKind.MUTATED):
            raise PaddingRefused(f"npugraph_ex capture_sizes: static input {node.name} has the "
                                 "padded dim; padding would have to copy it")
        pairs = []
        for d in dims:
            e = _compat.sym_expr(value.shape[d])
            if e is None or not e.is_Symbol:
                raise PaddingRefused(f"npugraph_ex capture_sizes: dim {d} of input "
                                     f"{names.get(node.name, node.name)!r} has size {e}, not a "
                                     "plain symbolic size; padding cannot rewrite it")
            pairs.append((d, symbols.index(e)))
        pad = pad_values.get(names.get(node.name, ""))
        if pad is not None and _fits(pad, value.dtype) is not None:
            raise PaddingRefused(
                f"option 'pad_values': value {pad!r} for {names[node.name]!r} is not allowed: "
                f"that input is {value.dtype}; allowed: {_fits(pad, value.dtype)}")
        padded_inputs.append(PaddedInput(slot, tuple(pairs), pad,
                                         inputs.kinds[slot] is SlotKind.MUTATED))

    for node in gm.graph.nodes:
        graph.check(node)

    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = out_node.args[0]
    outs = list(outs) if isinstance(outs, list | tuple) else [outs]
    padded_slots = {p.slot for p in padded_inputs}
    out_plan: list[tuple[tuple[int, int, int], ...]] = []
    for j, out in enumerate(outs):
        value = _val(out)
        if not isinstance(value, torch.Tensor):
            if graph.has_symbol(value):
                raise PaddingRefused(f"npugraph_ex capture_sizes: output {j} is the padded size "
                                     f"{value}, which a padded call changes")
            out_plan.append(())
            continue
        alias = outputs.aliases_input[j] if j < len(outputs.aliases_input) else None
        if alias in padded_slots and graph.pdims(out):
            raise PaddingRefused(f"npugraph_ex capture_sizes: output {j} is a view of the padded "
                                 f"input {names.get(nodes[alias].name, nodes[alias].name)!r}; a "
                                 "padded call would return a view of its padded copy")
        sliced: list[tuple[int, int, int]] = []
        for d in graph.pdims(out):
            e = _compat.sym_expr(value.shape[d])
            symbol = next((s for s in symbols if s in e.free_symbols), None)
            factor = e / symbol if symbol is not None else None
            if factor is None or factor.free_symbols or not factor.is_integer:
                raise PaddingRefused(
                    f"npugraph_ex capture_sizes: dim {d} of output {j} has size {e}, not a "
                    "padded size times a constant; its real part cannot be sliced back"
                    + (f" (from {where(out)})" if isinstance(out, torch.fx.Node) else ""))
            sliced.append((d, symbols.index(symbol), int(factor)))
        out_plan.append(tuple(sliced))
    return PaddingPlan(sizes, tuple(str(s) for s in symbols), tuple(locate),
                       tuple(padded_inputs), tuple(int_slots), tuple(out_plan))


def plan_for(
    gm: torch.fx.GraphModule, specs: GraphSpecs, config: CompilerConfig,
    names: ArgumentNames | None,
) -> PaddingPlan | None:
    """The padding plan of an AOT graph under ``config`` (None: no padding)."""
    if config.capture_sizes is None:
        if config.pad_values is not None:
            raise OptionError(
                f"option 'pad_values': value {config.pad_values!r} is not allowed without "
                "capture_sizes; allowed: None, or set capture_sizes (a list of sizes or 'auto')")
        return None
    sizes = resolved_capture_sizes(config)
    assert sizes is not None
    plan = plan_padding(gm, specs.inputs, specs.outputs, sizes, config.pad_values, names)
    if plan is not None and config.capture_sizes != "auto":
        plan = dataclasses.replace(plan, ahead=True)
    if plan is None:
        if names is not None and names.dynamic_off:
            raise OptionError(
                f"option 'capture_sizes': value {config.capture_sizes!r} needs dynamic "
                "shapes, and this graph has no symbolic size (torch.compile was given "
                "dynamic=False); allowed: compile with dynamic=True (or mark the batch dim "
                "dynamic with torch._dynamo.mark_dynamic), or capture_sizes=None")
        log.info("capture_sizes: the graph has no symbolic input size; nothing to pad")
        return None
    log.info("capture_sizes %s: padding symbols %s of inputs %s", list(plan.sizes),
             list(plan.symbols), [p.slot for p in plan.inputs])
    return plan

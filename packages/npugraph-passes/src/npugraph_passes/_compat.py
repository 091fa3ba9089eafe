"""Every private torch API the passes touch, each with the torch versions it was checked on.
A torch upgrade is a change to this file only. Entries are appended; each guards its import so
that torch 2.11 keeps working with a fallback. Every entry was also checked on torch 2.11.0
(Python 3.12): present with the same shape, except register_replacement, which has no
get_decomp_fn there (the fallback below applies)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

# torch._ops: the OpOverload types of dispatcher ops. Checked on 2.13.0 (stable since 2.0).
OpOverload: Any = torch._ops.OpOverload
OpOverloadPacket: Any = torch._ops.OpOverloadPacket
HigherOrderOperator: Any = torch._ops.HigherOrderOperator


# OpOverload._schema: the op's torch._C.FunctionSchema (name, arguments and returns with their
# alias_info, kwarg_only, default values). Checked on 2.13.0 (stable since 1.x).
def op_schema(op: Any) -> Any:
    return op._schema


# Symbolic-shape comparisons that never guard. Checked on 2.13.0 (present since 2.1).
def statically_known_true(x: Any) -> bool:
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true as known
    except ImportError:  # pragma: no cover - older torch
        return x is True
    return bool(known(x))


def sym_eq(a: Any, b: Any) -> Any:
    try:
        from torch.fx.experimental.symbolic_shapes import sym_eq as eq
    except ImportError:  # pragma: no cover - older torch
        return a == b
    return eq(a, b)


# Inductor's no-op rules (target -> (condition on fake args, source argument index or getter)).
# Checked on 2.13.0 (torch._inductor.fx_passes.post_grad.noop_registry, 34 entries); empty
# when inductor cannot be imported, and our own rules in noop.py still apply.
def inductor_noop_registry() -> dict[Any, tuple[Callable[..., bool], Any]]:
    try:
        from torch._inductor.fx_passes.post_grad import noop_registry
    except Exception:  # pragma: no cover - inductor unavailable
        return {}
    return dict(noop_registry)


# Fake arguments of a node from node.meta["val"]. Checked on 2.13.0.
def fake_args_kwargs(node: torch.fx.Node) -> tuple[bool, tuple[Any, ...], dict[str, Any]]:
    try:
        from torch._inductor.fx_utils import get_fake_args_kwargs
    except Exception:  # pragma: no cover
        return False, (), {}
    ok, args, kwargs = get_fake_args_kwargs(node)
    return bool(ok), tuple(args), dict(kwargs)


# Functional op -> its in-place overload with a matching schema (add.Tensor -> add_.Tensor).
# torch.fx.passes.reinplace._maybe_get_inplace_op, checked on 2.13.0; our own lookup by name
# and argument types when it is missing.
def inplace_overload(op: Any) -> Any:
    lookup: Any = None
    with contextlib.suppress(ImportError):
        from torch.fx.passes.reinplace import _maybe_get_inplace_op as lookup
    if lookup is not None:
        try:
            return lookup(op)
        except (AssertionError, RuntimeError, AttributeError):
            return None
    if not isinstance(op, OpOverload):  # pragma: no cover
        return None
    packet = getattr(getattr(torch.ops, op.namespace), f"{op._schema.name.split('::')[-1]}_", None)
    if packet is None:  # pragma: no cover
        return None
    for name in packet.overloads():
        cand = getattr(packet, name)
        if [a.type for a in cand._schema.arguments] == [a.type for a in op._schema.arguments]:
            return cand
    return None  # pragma: no cover


# Inductor's pattern matcher (PatternMatcherPass, register_replacement, fwd_only, Match).
# Checked on 2.13.0: register_replacement(search_fn, replace_fn, example_inputs, trace_fn,
# pass_dicts, extra_check, scalar_workaround, exclusive_arg_names, search_fn_pattern,
# skip_duplicates, pattern_name, get_decomp_fn); fwd_only(fn, args, *, run_functional_passes,
# get_decomp_fn). skip_duplicates only exists on torch >= 2.7, get_decomp_fn on newer ones:
# both are passed only when the installed signature has them.
def pattern_matcher() -> Any:
    from torch._inductor import pattern_matcher as pm

    return pm


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def no_decompositions() -> dict[Any, Any]:
    return {}


def fwd_only_no_decomp(fn: Callable[..., Any], args: Any, **kwargs: Any) -> torch.fx.GraphModule:
    """inductor's fwd_only (make_fx, real tensors, no-op removal) with no decompositions."""
    pm = pattern_matcher()
    kwargs.pop("get_decomp_fn", None)
    if _accepts(pm.fwd_only, "get_decomp_fn"):
        gm: torch.fx.GraphModule = pm.fwd_only(fn, args, get_decomp_fn=no_decompositions, **kwargs)
        return gm
    from torch.fx.experimental.proxy_tensor import make_fx  # pragma: no cover - torch < 2.12

    gm = make_fx(fn, {}, tracing_mode="real")(*args)  # pragma: no cover
    gm.graph.eliminate_dead_code()  # pragma: no cover
    gm.recompile()  # pragma: no cover
    return gm  # pragma: no cover


def inductor_register_replacement(
    search_fn: Callable[..., Any],
    replace_fn: Callable[..., Any],
    example_inputs: Any,
    trace_fn: Callable[..., Any],
    pass_dict: Any,
    extra_check: Callable[[Any], bool],
    scalar_workaround: Any,
    search_fn_pattern: Any,
    skip_duplicates: bool,
) -> bool:
    pm = pattern_matcher()
    kwargs: dict[str, Any] = dict(
        extra_check=extra_check,
        scalar_workaround=scalar_workaround,
        search_fn_pattern=search_fn_pattern,
    )
    if _accepts(pm.register_replacement, "skip_duplicates"):
        kwargs["skip_duplicates"] = skip_duplicates
    if _accepts(pm.register_replacement, "get_decomp_fn"):
        kwargs["get_decomp_fn"] = no_decompositions
    else:  # pragma: no cover - older torch calls trace_fn without it
        inner = trace_fn
        trace_fn = lambda fn, args, **kw: inner(fn, args)  # noqa: E731
    return bool(pm.register_replacement(search_fn, replace_fn, example_inputs, trace_fn, pass_dict, **kwargs))


# Fake-tensor mode of a set of values (to compute meta of nodes made by a replacement).
# torch._guards.detect_fake_mode, checked on 2.13.0.
def detect_fake_mode(values: Any) -> Any:
    try:
        from torch._guards import detect_fake_mode as detect
    except ImportError:  # pragma: no cover
        return None
    return detect(values)


# A fresh FakeTensorMode to trace patterns whose ops have no CPU kernel (torch_npu ops).
# torch._subclasses.fake_tensor.FakeTensorMode, checked on 2.13.0.
def fake_tensor_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


# The inference graph AOTAutograd hands a backend (what our passes see), for tests and
# benchmarks: aot_function with keep_inference_input_mutations=True, no decompositions.
# torch._functorch.aot_autograd.aot_function, checked on 2.13.0.
def aot_inference_graph(fn: Callable[..., Any], example_inputs: Any) -> tuple[torch.fx.GraphModule, list[Any]]:
    """Traces ``fn(*example_inputs)`` under no_grad and returns (forward graph, its example
    inputs as AOT saw them). The inputs are not mutated."""
    from torch._functorch.aot_autograd import aot_function

    captured: list[tuple[torch.fx.GraphModule, list[Any]]] = []

    def compiler(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        captured.append((gm, list(inputs)))
        return gm

    compiler_any: Any = compiler
    compiled = aot_function(fn, fw_compiler=compiler_any, keep_inference_input_mutations=True)
    clones = [a.clone() if isinstance(a, torch.Tensor) else a for a in example_inputs]
    with torch.no_grad():
        compiled(*clones)
    return captured[0]


# The graph our backend receives through torch.compile: dynamo, then aot_module_simplified with
# keep_inference_input_mutations=True (node.meta["stack_trace"] holds the user's lines).
# torch._functorch.aot_autograd.aot_module_simplified and torch._dynamo.reset, checked on 2.13.0.
def compiled_inference_graphs(fn: Callable[..., Any], example_inputs: Any,
                              dynamic: bool | None = None) -> list[tuple[torch.fx.GraphModule, list[Any]]]:
    """Every AOT forward graph torch.compile makes of ``fn(*example_inputs)`` (run once, under
    no_grad, on clones of the inputs), each with the real tensors its placeholders stand for
    (parameters, buffers and inputs as dynamo passed them; AOT's fake ones when they differ).
    ``dynamic`` is torch.compile's (True: symbolic sizes)."""
    import torch._dynamo
    from torch._functorch.aot_autograd import aot_module_simplified

    captured: list[tuple[torch.fx.GraphModule, list[Any]]] = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        real = list(inputs)

        def fw(fw_gm: torch.fx.GraphModule, fw_inputs: Any) -> Any:
            placeholders = [n for n in fw_gm.graph.nodes if n.op == "placeholder"]
            captured.append((fw_gm, real if len(placeholders) == len(real) else list(fw_inputs)))
            return fw_gm

        fw_any: Any = fw
        return aot_module_simplified(gm, inputs, fw_compiler=fw_any, keep_inference_input_mutations=True)

    torch._dynamo.reset()
    clones = [a.clone() if isinstance(a, torch.Tensor) else a for a in example_inputs]
    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*clones)
    return captured


# Functionalized custom ops with mutable arguments, and inductor's decomposition of them into
# (selective) clones plus the mutating op. Checked on 2.13.0: auto_functionalized (v1: mutable
# args by name, meta["only_clone_these_tensors"] = names) and auto_functionalized_v2 (bases in
# kwargs["_all_bases"], meta["only_clone_these_tensors"] = base indices).
def auto_functionalized_ops() -> tuple[Any, Any]:
    higher_order = torch.ops.higher_order
    return (getattr(higher_order, "auto_functionalized", None),
            getattr(higher_order, "auto_functionalized_v2", None))


def decompose_auto_functionalized(graph: torch.fx.Graph) -> None:
    from torch._inductor.fx_passes import post_grad

    decompose: Any = post_grad.decompose_auto_functionalized
    decompose(graph)


# torch._inductor.pattern_matcher Match.ctx.pattern_to_node and the pattern exprs' .kwargs,
# checked on 2.13.0 (present since 2.1). The matcher drops a node's keyword arguments the pattern
# does not name (_TargetArgsExpr._match keeps only ``i in self.kwargs``), so
# ``add(mm, bias, alpha=2)`` matches a pattern traced from ``mm + bias``. Inductor never sees such
# a node (it decomposes first); we match undecomposed ATen, so we check them ourselves.
def match_drops_kwargs(match: Any) -> bool:
    """True when a node of ``match`` has a keyword argument, not equal to its schema default,
    that the pattern does not name (the replacement would silently lose it). A match whose
    structure is unknown answers True: refusing a fusion is always safe."""
    try:
        pairs = list(match.ctx.pattern_to_node.items())
    except AttributeError:
        return True
    for pattern, node in pairs:
        p_kwargs = getattr(pattern, "kwargs", None)
        if not isinstance(node, torch.fx.Node) or node.op != "call_function":
            continue
        if not isinstance(p_kwargs, dict):
            continue  # an input (KeywordArg, Arg): not an op of the pattern
        for name, value in node.kwargs.items():
            if name in p_kwargs:
                continue
            has_default, default = _schema_default(node, name)
            if not has_default or default != value:
                return True
    return False


def _schema_default(node: torch.fx.Node, name: str) -> tuple[bool, Any]:
    schema = getattr(node.target, "_schema", None)
    for arg in getattr(schema, "arguments", ()):
        if arg.name == name:
            return (True, arg.default_value) if arg.has_default_value() else (False, None)
    return False, None


# Namespace and bare name of a dispatcher op (``_c10d_functional``, ``all_reduce_``), from
# OpOverload.namespace and the schema name; how the passes recognise collectives, since torch
# has no collective tag (torch.Tag on 2.13.0 has none). Checked on 2.13.0 (stable since 2.0).
def op_namespace_and_name(op: object) -> tuple[str, str] | None:
    if not isinstance(op, OpOverload):
        return None
    return str(op.namespace), str(op._schema.name.split("::")[-1])

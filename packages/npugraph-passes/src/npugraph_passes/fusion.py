"""pattern_fusion_pass: torch's pattern matcher over our own pattern table.

Patterns are traced with no decompositions (the graph we match is ATen IR as AOT produced it),
registered into one :class:`PatternMatcherPass` that belongs to npugraph-ex (never inductor's),
and applied by :func:`pattern_fusion_pass`. A match is refused when it contains a collective or
its wait, or spans one (the replacement is computed at one point, which would move the matched
reads and writes across it). Built-in rules pay off on any device: ``mm + add``
-> ``addmm`` and ``bmm + add`` -> ``baddbmm`` (one kernel, no temporary). Ascend rules
(``npu_patterns.py``) are registered only when torch_npu provides their ops. Every rule also
requires the matched nodes to run on one stream.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from npugraph_passes import _compat
from npugraph_passes.cleanup import dead_code_elimination
from npugraph_passes.collectives import is_ordering_point
from npugraph_passes.equivalents import use_cheaper_equivalents
from npugraph_passes.identity import combine, source_digest
from npugraph_passes.npu_patterns import register_npu_patterns
from npugraph_passes.stream_safety import StreamMap

_lock = threading.Lock()
_user_rules: list[str] = []
_state = threading.local()


@functools.cache
def pattern_pass() -> Any:
    """The one PatternMatcherPass of npugraph-ex (built-in and user rules)."""
    return _compat.pattern_matcher().PatternMatcherPass(pass_name="npugraph_ex_pattern_fusion")


def fwd_only(fn: Callable[..., Any], args: Sequence[Any], **kwargs: Any) -> torch.fx.GraphModule:
    """Traces ``fn`` on ``args`` into an ATen inference graph with no decompositions."""
    return _compat.fwd_only_no_decomp(fn, args, **kwargs)


def _one_stream(match: Any) -> bool:
    streams: StreamMap | None = getattr(_state, "streams", None)
    if streams is None or not streams.multi_stream:
        return True
    labels = {streams.label.get(n) for n in match.nodes if n.op == "call_function"}
    return len(labels) <= 1


def _not_across_collectives(match: Any) -> bool:
    if not getattr(_state, "collectives", False):
        return True
    nodes = [n for n in match.nodes if n.op == "call_function"]
    if not nodes:
        return True
    position = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    first = min(nodes, key=lambda n: position[n])
    last = max(nodes, key=lambda n: position[n])
    node: torch.fx.Node = first
    while True:
        if is_ordering_point(node):
            return False
        if node is last:
            return True
        node = node.next


def _always(match: Any) -> bool:
    return True


def register_replacement(
    search_fn: Callable[..., Any],
    replace_fn: Callable[..., Any],
    example_inputs: Sequence[Any],
    trace_fn: Callable[..., Any] = fwd_only,
    extra_check: Callable[[Any], bool] = _always,
    search_fn_pattern: Any = None,
    scalar_workaround: dict[str, float | int] | None = None,
    skip_duplicates: bool = False,
) -> None:
    """Registers "wherever ``search_fn`` appears, compute ``replace_fn`` instead" into the
    npugraph-ex pattern pass (applied when ``pattern_fusion_pass`` is on).

    The user guarantees that ``replace_fn`` computes the same values as ``search_fn`` for every
    input ``extra_check`` accepts. ``example_inputs`` only fix ranks and dtypes for tracing.
    """
    ensure_builtin_patterns()
    _register(search_fn, replace_fn, example_inputs, trace_fn, extra_check, search_fn_pattern,
              scalar_workaround, skip_duplicates)
    digest = combine(*(source_digest(f) for f in (search_fn, replace_fn, extra_check)),
                     repr(sorted((scalar_workaround or {}).items())))
    with _lock:
        if digest not in _user_rules:
            _user_rules.append(digest)


def user_rule_digests() -> tuple[str, ...]:
    """Digests of the rules registered through :func:`register_replacement`, in order: part of
    the pattern pass's identity, so a cache never reuses a graph fused without them."""
    with _lock:
        return tuple(_user_rules)


def _register(
    search_fn: Callable[..., Any],
    replace_fn: Callable[..., Any],
    example_inputs: Sequence[Any],
    trace_fn: Callable[..., Any],
    extra_check: Callable[[Any], bool],
    search_fn_pattern: Any,
    scalar_workaround: dict[str, float | int] | None,
    skip_duplicates: bool,
) -> None:
    def check(match: Any) -> bool:
        # torch's matcher ignores keyword arguments the pattern does not name (add's alpha):
        # a match that would lose one is refused.
        if _compat.match_drops_kwargs(match):
            return False
        return _one_stream(match) and _not_across_collectives(match) and bool(extra_check(match))

    with _lock:
        _compat.inductor_register_replacement(
            search_fn, replace_fn, list(example_inputs), trace_fn, pattern_pass(), check,
            scalar_workaround, search_fn_pattern, skip_duplicates,
        )


def _val(match: Any, name: str) -> torch.Tensor | None:
    node = match.kwargs.get(name)
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


_PRODUCTS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)


def _bias_fits(match: Any) -> bool:
    """The add keeps the product's shape and dtype (no broadcasting beyond it, no promotion)."""
    output = match.output_node()
    product = next((n for n in match.nodes if n.target in _PRODUCTS), None)
    out = output.meta.get("val") if output is not None else None
    prod = product.meta.get("val") if product is not None else None
    bias = _val(match, "bias")
    if not (isinstance(out, torch.Tensor) and isinstance(prod, torch.Tensor) and isinstance(bias, torch.Tensor)):
        return False
    return (
        _compat.statically_known_true(_compat.sym_eq(out.shape, prod.shape))
        and out.dtype == prod.dtype == bias.dtype
        and bias.device == prod.device
    )


def _mm_add(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b) + bias


def _add_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return bias + torch.mm(a, b)


def _addmm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.addmm(bias, a, b)


def _bmm_add(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.bmm(a, b) + bias


def _add_bmm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return bias + torch.bmm(a, b)


def _baddbmm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.baddbmm(bias, a, b)


@functools.cache
def ensure_builtin_patterns() -> None:
    """Registers the built-in rules once per process (and the NPU ones where torch_npu has them)."""
    mm_inputs = [torch.empty(2, 3), torch.empty(3, 4), torch.empty(4)]
    bmm_inputs = [torch.empty(2, 2, 3), torch.empty(2, 3, 4), torch.empty(4)]
    for search in (_mm_add, _add_mm):
        _register(search, _addmm, mm_inputs, fwd_only, _bias_fits, None, None, False)
    for search in (_bmm_add, _add_bmm):
        _register(search, _baddbmm, bmm_inputs, fwd_only, _bias_fits, None, None, False)
    register_npu_patterns(_register)


def _fill_missing_vals(graph: torch.fx.Graph) -> None:
    """Nodes made by a replacement get ``meta["val"]`` like the rest (later passes need it)."""
    for node in graph.nodes:
        if node.op != "call_function" or "val" in node.meta:
            continue
        ok = True

        def fake(a: torch.fx.Node) -> Any:
            nonlocal ok
            if "val" not in a.meta:
                ok = False
                return None
            return a.meta["val"]

        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), fake)
        if not ok:
            continue
        mode = _compat.detect_fake_mode([args, kwargs])
        try:
            if mode is not None:
                with mode:
                    node.meta["val"] = node.target(*args, **kwargs)  # type: ignore[operator]
            else:
                node.meta["val"] = node.target(*args, **kwargs)  # type: ignore[operator]
        except Exception:
            # Leaves the node without meta: later passes skip nodes they cannot analyse.
            continue


def pattern_fusion_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
    """Applies every registered rule (built-in and ``register_replacement``) to ``gm``, then the
    single-op cheaper forms of ``equivalents``."""
    ensure_builtin_patterns()
    _state.streams = StreamMap(gm.graph)
    _state.collectives = any(is_ordering_point(n) for n in gm.graph.nodes)
    try:
        count = pattern_pass().apply(gm)
    finally:
        _state.streams = None
        _state.collectives = False
    use_cheaper_equivalents(gm, example_inputs, config)
    if count:
        _fill_missing_vals(gm.graph)
        dead_code_elimination(gm, example_inputs, config)

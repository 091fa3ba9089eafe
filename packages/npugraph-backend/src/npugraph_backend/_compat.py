"""Every private torch API the backend touches, each with the torch versions it was checked on.
A torch upgrade is a change to this file only. (Shared file: append, do not rewrite others' entries.)
Every entry was also checked on torch 2.11.0 (Python 3.12): present with the same shape (the
stream entries: see there)."""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx


# --- AOTAutograd entry -----------------------------------------------------------------------
# torch._functorch.aot_autograd.aot_module_simplified: checked on 2.13.0 (keyword
# keep_inference_input_mutations and inference_compiler present since 2.0). Imported on first use:
# it pulls in all of dynamo, which `import npugraph_ex` should not pay for.
def aot_module_simplified(*args: Any, **kwargs: Any) -> Any:
    from torch._functorch.aot_autograd import aot_module_simplified as _aot

    return _aot(*args, **kwargs)


# --- TracingContext (AOT metadata of the graph being compiled) --------------------------------
# torch._guards.TracingContext.try_get().fw_metadata (a ViewAndMutationMeta): checked on 2.13.0;
# fields input_info[i].mutates_data, output_info[i].output_type/base_idx, static_input_indices,
# mutated_inp_runtime_indices, tokens exist since 2.4.
from torch._guards import TracingContext as _TracingContext  # noqa: E402


@dataclass(frozen=True)
class AotMetadata:
    """The parts of AOT's ViewAndMutationMeta the backend uses, in plain types."""

    static_input_indices: frozenset[int]
    mutates_data: tuple[bool, ...]  # per original (pre-AOT) flat input
    # per user output: ("alias_of_input" | "is_input" | "non_alias" | ..., base input index or None)
    outputs: tuple[tuple[str, int | None], ...]
    num_mutated_outputs: int  # mutated inputs returned as leading outputs (not kept in graph)
    num_tokens: int


def aot_metadata() -> AotMetadata | None:
    """The AOT metadata of the graph being compiled now, or None outside AOT compilation."""
    ctx = _TracingContext.try_get()
    md = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    if md is None:
        return None
    outputs = tuple(
        (getattr(o.output_type, "name", str(o.output_type)), o.base_idx) for o in md.output_info
    )
    return AotMetadata(
        static_input_indices=frozenset(getattr(md, "static_input_indices", ()) or ()),
        mutates_data=tuple(bool(i.mutates_data) for i in md.input_info),
        outputs=outputs,
        num_mutated_outputs=len(getattr(md, "mutated_inp_runtime_indices", ()) or ()),
        num_tokens=len(getattr(md, "tokens", {}) or {}),
    )


# --- AOT input/output descriptors --------------------------------------------------------------
# node.meta["desc"] on placeholders (AOTInput) and the output node (list of AOTOutput):
# torch._functorch._aot_autograd.descriptors, checked on 2.13.0 (ParamAOTInput, BufferAOTInput,
# PlainAOTInput(idx), ViewBaseAOTInput, SyntheticBaseAOTInput, PlainAOTOutput(idx), ...).
# torch 2.11 may not set "desc": the callers then fall back to the order of fw_metadata.input_info
# (placeholders = tokens + flat inputs, in order) and to structural aliasing for outputs.
try:
    from torch._functorch._aot_autograd import descriptors as _desc

    HAS_DESCRIPTORS = True
except ImportError:  # torch < 2.9
    _desc = None  # type: ignore[assignment]
    HAS_DESCRIPTORS = False


def input_origin(node: torch.fx.Node) -> tuple[str, int | None]:
    """Where a placeholder comes from: ("param"|"buffer", None), ("plain", flat input index),
    ("other", None) for synthetic/view bases, tokens, subclass parts; ("unknown", None) when the
    node carries no descriptor."""
    desc = node.meta.get("desc")
    if desc is None or _desc is None:
        return ("unknown", None)
    if isinstance(desc, _desc.ParamAOTInput):
        return ("param", None)
    if isinstance(desc, _desc.BufferAOTInput):
        return ("buffer", None)
    if isinstance(desc, _desc.PlainAOTInput):
        return ("plain", int(desc.idx))
    return ("other", None)


def output_origins(gm: torch.fx.GraphModule) -> list[tuple[str, int | None]] | None:
    """Per graph output: ("plain", user output index), ("mutation", None), ("other", None); None
    when the output node carries no descriptors."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    descs = out.meta.get("desc")
    if descs is None or _desc is None:
        return None
    result: list[tuple[str, int | None]] = []
    for d in descs:
        if isinstance(d, _desc.PlainAOTOutput):
            result.append(("plain", int(d.idx)))
        elif isinstance(d, _desc.InputMutationAOTOutput):
            result.append(("mutation", None))
        else:
            result.append(("other", None))
    return result


# torch._C._is_alias_of: checked on 2.13.0 (works on fake tensors); structural fallback for
# outputs that alias inputs when descriptors are missing.
def is_alias_of(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch._C._is_alias_of(a, b))  # type: ignore[attr-defined]


# --- Static inputs outside AOT (compile_fx on a hand-made graph) -------------------------------
# Tensor attribute `_dynamo_static_input_type` set by torch._dynamo.mark_static_address: 2.13.0.
def marked_static(x: object) -> bool:
    return isinstance(x, torch.nn.Parameter) or hasattr(x, "_dynamo_static_input_type")


# --- Dynamo counters ---------------------------------------------------------------------------
# torch._dynamo.utils.counters: a defaultdict(Counter), checked on 2.13.0 (since 1.13).
def counters() -> Counter[str]:
    from torch._dynamo.utils import counters as _counters

    c: Counter[str] = _counters["npugraph_ex"]
    return c


def dynamo_counters() -> Any:
    from torch._dynamo.utils import counters as _counters

    return _counters


# --- Backend registry --------------------------------------------------------------------------
# torch._dynamo.list_backends: public-ish, under torch._dynamo; checked on 2.13.0.
def list_backends() -> list[str]:
    import torch._dynamo

    return list(torch._dynamo.list_backends(exclude_tags=()))


# --- torch logging registry --------------------------------------------------------------------
# torch._logging._internal.register_log and _init_logs: checked on 2.13.0 (since 2.1). TORCH_LOGS
# is parsed when torch is imported, before our registration, so re-parse when it names us.
def register_log(name: str) -> None:
    try:
        from torch._logging import _internal
    except ImportError:
        return
    if name in getattr(_internal.log_registry, "log_alias_to_log_qnames", {}):
        return
    _internal.register_log(name, name)
    if name in os.environ.get("TORCH_LOGS", ""):
        _internal._init_logs()
    logging.getLogger(name)


# --- Boxed calling convention ------------------------------------------------------------------
# AOT calls a compiled forward with one list argument when it has `_boxed_call = True`
# (torch._functorch._aot_autograd.utils.make_boxed_func): checked on 2.13.0 (since 2.0).
BOXED_CALL_ATTR = "_boxed_call"


def make_boxed(fn: Callable[..., Any]) -> Callable[[list[Any]], Any]:
    from torch._functorch.aot_autograd import make_boxed_func  # type: ignore[attr-defined]

    return make_boxed_func(fn)


def dynamo_reset() -> None:
    """torch._dynamo.reset: checked on 2.13.0."""
    import torch._dynamo

    torch._dynamo.reset()


def symint_is_symbolic(s: object) -> bool:
    """True for a SymInt/SymFloat/SymBool whose value is not a known constant."""
    if isinstance(s, torch.SymInt | torch.SymFloat | torch.SymBool):
        node = s.node
        return not (hasattr(node, "is_constant") and node.is_constant())
    return False


def example_value(node: torch.fx.Node, fallback: object) -> object:
    """node.meta["val"] (the fake value FX/AOT record), or the example input."""
    return node.meta.get("val", fallback)


def placeholders(gm: torch.fx.GraphModule) -> Sequence[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


# --- dfx/debug.py: the run directory of TORCH_COMPILE_DEBUG (DFX helper) -----------------------
def dynamo_debug_dir() -> str:
    """``torch._dynamo.utils.get_debug_dir()``: ``<debug_dir_root>/run_<time>-pid_<pid>``, the
    root honouring TORCH_COMPILE_DEBUG_DIR. Checked on torch 2.13.0 (same name since 2.0). It
    returns a fresh timestamp on every call, so callers cache it. Fallback: the same layout under
    the current directory."""
    try:
        from torch._dynamo.utils import get_debug_dir
    except ImportError:  # pragma: no cover - torch without dynamo
        import datetime

        root = os.environ.get("TORCH_COMPILE_DEBUG_DIR", os.getcwd())
        stamp = datetime.datetime.now().strftime("%Y_%m_%d_%H_%M_%S_%f")
        return os.path.join(root, "torch_compile_debug", f"run_{stamp}-pid_{os.getpid()}")
    return str(get_debug_dir())


# --- dfx/ranges.py: is a profiler recording? (DFX helper) ---------------------------------------
# torch.autograd.profiler._is_profiler_enabled: a module global set by every torch profiler on
# start and cleared on stop, so the check is one attribute read (it sits on hot paths). Checked on
# torch 2.13.0 (present since 1.13); fallback: the C query torch.autograd._profiler_enabled().
import torch.autograd.profiler as _autograd_profiler  # noqa: E402

if hasattr(_autograd_profiler, "_is_profiler_enabled"):

    def profiler_enabled() -> bool:
        return bool(_autograd_profiler._is_profiler_enabled)

else:  # pragma: no cover - older torch

    def profiler_enabled() -> bool:
        return bool(torch.autograd._profiler_enabled())  # type: ignore[attr-defined]


# torch._ops.OpOverload and its `_schema`: checked on 2.13.0 (since 1.12).
def op_schema(node: torch.fx.Node) -> Any:
    """The schema of an ATen/custom op node, or None for anything else."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema
    return None


# torch._dynamo.mark_static_address: checked on 2.13.0 (since 2.2). Used by tests and users to
# make an input static (never copied, like a parameter).
def mark_static_address(t: torch.Tensor) -> None:
    import torch._dynamo

    torch._dynamo.mark_static_address(t)


# --- serialization.py: the compiled graph as an AOTAutograd-cacheable OutputCode ---------------
# torch._inductor.output_code.OutputCode (boxed __call__, prepare_for_serialization, post_compile,
# set_triton_bundle): checked on 2.13.0, exists since 2.6. AOTAutograd's bundled cache
# (BundledAOTAutogradResult) stores any OutputCode subclass whole and calls post_compile on load.
from torch._inductor.output_code import OutputCode as OutputCode  # noqa: E402


def serialization_wanted() -> bool:
    """Checked on 2.13.0: torch._functorch.config.bundled_autograd_cache / force_autograd_cache
    (aot_compile patches both) and torch._dynamo.config.caching_precompile decide whether
    AOTAutograd bundles the compiled forward into its cache entry."""
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config

    return bool(
        getattr(functorch_config, "bundled_autograd_cache", False)
        or getattr(functorch_config, "force_autograd_cache", False)
        or getattr(dynamo_config, "caching_precompile", False)
    )


def serializable_aot_compiler(compiler: Callable[..., Any]) -> Any:
    """Checked on 2.13.0: torch._functorch._aot_autograd.schemas.SerializableAOTDispatchCompiler;
    AOTAutograd consults its cache only when fw_compiler is one (or force_autograd_cache)."""
    from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler

    return SerializableAOTDispatchCompiler(OutputCode, compiler)


def graph_pickle(
    gm: torch.fx.GraphModule,
    ops_filter: Callable[[str], bool],
    meta_filter: Callable[[str], bool],
) -> bytes:
    """Checked on 2.13.0: torch.fx._graph_pickler.GraphPickler.dumps with Options(ops_filter,
    node_metadata_key_filter); an op the filter refuses bypasses the cache (BypassFxGraphCache)."""
    from torch.fx._graph_pickler import GraphPickler, Options

    return GraphPickler.dumps(
        gm, Options(ops_filter=ops_filter, node_metadata_key_filter=meta_filter)
    )


def graph_unpickle(data: bytes, example_inputs: Sequence[object]) -> torch.fx.GraphModule:
    """Checked on 2.13.0: GraphPickler.loads(data, fake_mode); the fake mode comes from the
    example inputs or the tracing context, else a fresh one (a cache load has neither)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode(shape_env=ShapeEnv())
    gm = GraphPickler.loads(data, fake_mode)
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(f"expected a GraphModule in the cache entry, got {type(gm).__name__}")
    gm.recompile()
    return gm


def bypass_cache(reason: str) -> Exception:
    """Checked on 2.13.0: torch._functorch._aot_autograd.autograd_cache.BypassAOTAutogradCache;
    raised while saving, AOTAutograd skips the cache for this graph (or raises in strict mode)."""
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache

    return BypassAOTAutogradCache(reason)


# --- dfx/data_dump.py: real host buffers while AOT's fake mode is active (DFX helper) ----------
# torch._subclasses.fake_tensor.unset_fake_temporarily: the compiler runs under AOT's
# FakeTensorMode, where torch.empty would make a fake buffer. Checked on torch 2.13.0 (present
# since 2.1); fallback: no fake mode to leave.
def real_tensors() -> Any:
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # pragma: no cover - older torch
        import contextlib

        return contextlib.nullcontext()
    return unset_fake_temporarily()


# --- process_groups.py ------------------------------------------------------------------------------
def resolve_process_group(group_name: str) -> Any:
    """Checked on torch 2.13.0 and 2.11: ``distributed_c10d._resolve_process_group`` maps the
    group name a traced collective carries to the ProcessGroup registered under it now; it raises
    when none is. None when torch.distributed is unavailable."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    from torch.distributed import distributed_c10d

    resolve: Callable[[str], Any] = distributed_c10d._resolve_process_group  # type: ignore[attr-defined,assignment]
    return resolve(group_name)


# --- torch_streams.py: dynamo's own stream ops (torch.Stream / torch.Event in compiled code) -----
# Checked on torch 2.13.0: dynamo traces ``with stream:`` as ``node.meta["custom"]["stream"] =
# index`` and Stream/Event methods as ``torch.ops.streams.<name>(event_index, stream_index, ...)``;
# the index names an object of ``torch._dynamo.graph_bytecode_inputs`` (the trace-time object
# while the backend runs). Checked on 2.11.0 too: the same ops with the same schemas (2.13.0 adds
# the host syncs synchronize_device/_event/_stream), so 2.11 is rewritten alike.
DYNAMO_STREAM_NAMESPACE = "streams"


def stream_op_name(node: torch.fx.Node) -> str | None:
    """The name of a ``torch.ops.streams`` op called by ``node`` (OpOverloadPacket or overload)."""
    if node.op != "call_function":
        return None
    target: Any = node.target
    qualified = getattr(target, "_qualified_op_name", None)  # OpOverloadPacket
    if qualified is None and hasattr(target, "_schema"):  # OpOverload
        qualified = str(target._schema.name)
    if not isinstance(qualified, str) or "::" not in qualified:
        return None
    namespace, name = qualified.split("::", 1)
    return name if namespace == DYNAMO_STREAM_NAMESPACE else None


def is_external_object_lookup(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target: Any = node.target
    return (
        getattr(target, "__name__", "") == "get_external_object_by_index"
        and getattr(target, "__module__", "") == "torch._dynamo.graph_bytecode_inputs"
    )


def external_object(index: int) -> Any:
    """The object dynamo registered under ``index`` for the graph being traced, or None."""
    try:
        from torch._dynamo.graph_bytecode_inputs import get_external_object_by_index
    except ImportError:  # pragma: no cover - older torch
        return None
    try:
        return get_external_object_by_index(index)
    except AssertionError:
        return None


def install_cpu_stream_hint(message: str) -> None:
    """Checked on torch 2.13.0: ``SymbolicStreamState.cur_stream`` indexes an empty deque when no
    accelerator is available (``Event.record()`` / ``Event.wait()`` with no stream, on the CPU),
    which surfaces as a bare ``IndexError``. Wrapped once so it is dynamo's ``Unsupported`` with
    ``message`` instead (a graph break; with ``fullgraph=True`` the user reads the message)."""
    try:
        from torch._dynamo.exc import unimplemented
        from torch._dynamo.variables.streams import SymbolicStreamState
    except ImportError:  # pragma: no cover - older torch
        return
    original = SymbolicStreamState.cur_stream
    if getattr(original, "_npugraph_ex_hint", False):
        return

    def cur_stream(self: Any, device: torch.device | None = None) -> Any:
        if not self.cur_stream_stack:
            unimplemented(
                gb_type="torch.Event without a stream on a device with no accelerator",
                context="torch.Event.record() / wait() with no stream argument",
                explanation=message,
                hints=[],
            )
        return original(self, device)

    cur_stream._npugraph_ex_hint = True  # type: ignore[attr-defined]
    SymbolicStreamState.cur_stream = cur_stream  # type: ignore[method-assign]


# --- Symbols of SymInt placeholders (scalar_inputs) ----------------------------------------------
# SymInt.node.expr (a sympy expression; a bare Symbol for an int dynamo made symbolic),
# torch.fx.experimental.symbolic_shapes.free_symbols and torch._guards.detect_fake_mode: checked
# on 2.13.0.
def symint_symbol(value: object) -> object | None:
    """The sympy Symbol a SymInt stands for, or None (a plain int, or an expression)."""
    if not isinstance(value, torch.SymInt):
        return None
    expr = getattr(value.node, "expr", None)
    return expr if getattr(expr, "is_Symbol", False) else None


def layout_symbols(t: torch.Tensor) -> set[object]:
    """The symbols of a fake tensor's sizes, strides and storage offset."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    return set(free_symbols((*t.shape, *t.stride(), t.storage_offset())))


def fake_mode_of(values: Sequence[object]) -> Any:
    """The FakeTensorMode of the fake tensors among ``values`` (None if there are none)."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])


# --- symbolic sizes for padding (padding_analysis.py) ------------------------------------------
# SymInt.node.expr (the sympy expression of a symbolic size) and torch._dynamo.config's
# assume_static_by_default / automatic_dynamic_shapes (what torch.compile's dynamic= set):
# checked on 2.13.0 and 2.11.0.
def sym_expr(s: object) -> Any:
    """The sympy expression of a symbolic int (None for a plain int or anything else)."""
    if isinstance(s, torch.SymInt) and symint_is_symbolic(s):
        return s.node.expr
    return None


def dynamic_shapes_off() -> bool:
    """torch.compile(..., dynamic=False) is compiling: no graph of it will have symbolic sizes."""
    import torch._dynamo.config as dynamo_config

    return bool(dynamo_config.assume_static_by_default) and not dynamo_config.automatic_dynamic_shapes


def _name_from_placeholder(node: torch.fx.Node) -> str | None:
    """The argument a Dynamo placeholder without its grapharg (the aot_compile behind
    cache_compile drops it) is named after: Dynamo names the placeholder of argument ``x``
    ``l_x_``; ``l_self_...`` are the module's attributes. (Names are sanitised, so an argument
    reached through a container is not told apart from one with underscores: such a name
    matches no argument the user gives.)"""
    name = node.name
    if not (name.startswith("l_") and name.endswith("_")) or name.startswith("l_self_"):
        return None
    inner = name[2:-1]
    return inner if inner.isidentifier() else None


def dynamo_input_names(gm: torch.fx.GraphModule) -> tuple[str | None, ...]:
    """Per Dynamo placeholder, the forward argument it is (``LocalSource``'s local name), or None
    (an attribute, a parameter, a shape); from ``node.meta["grapharg"].source``, else from the
    placeholder's name."""
    names: list[str | None] = []
    for node in placeholders(gm):
        grapharg = node.meta.get("grapharg")
        if grapharg is None:
            names.append(_name_from_placeholder(node))
            continue
        source = getattr(grapharg, "source", None)
        names.append(getattr(source, "local_name", None) if type(source).__name__ == "LocalSource"
                     else None)
    return tuple(names)


def dynamo_input_labels(gm: torch.fx.GraphModule) -> tuple[str | None, ...]:
    """Per Dynamo placeholder, how the user's code names it (``Source.name``: ``L['self'].kc``),
    for messages. ``name`` is a cached property on 2.13, a method before."""
    labels: list[str | None] = []
    for node in placeholders(gm):
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = getattr(source, "name", None)
        name = name() if callable(name) else name
        labels.append(name if isinstance(name, str) else node.name)
    return tuple(labels)


def dynamo_argument_names(gm: torch.fx.GraphModule) -> tuple[str, ...]:
    """The forward's argument names that reach this graph (the base ``LocalSource`` of every
    placeholder's source), sorted."""
    found: set[str] = {n for n in dynamo_input_names(gm) if n is not None}
    for node in placeholders(gm):
        source = getattr(node.meta.get("grapharg"), "source", None)
        while source is not None and type(source).__name__ != "LocalSource":
            source = getattr(source, "base", None)
        name = getattr(source, "local_name", None)
        if isinstance(name, str) and name != "self":
            found.add(name)
    return tuple(sorted(found))


# --- padding.py: captures ahead outside AOT's first-call analyzer ---------------------------------
# torch._functorch._aot_autograd.runtime_wrappers._AnalyzeCustomOpInputOutputMode: the dispatch
# mode AOT's runtime wrapper pushes over the first call of a compiled graph, to check that custom
# ops do not alias their inputs; torch.utils._python_dispatch._get_current_dispatch_mode and
# _pop_mode_temporarily. Checked on torch 2.13.0; fallback (a torch without that mode): nothing
# to pause.
def first_call_analyzer_paused() -> Any:
    """A context in which AOT's first-call analyzer, when it is the innermost dispatch mode, is
    off the mode stack. Its per-op Python work (a pytree flatten of every op's arguments) made a
    CPU capture ahead ~30% slower; the call's own run is analyzed, and a capture ahead runs the
    same graph on the same ops."""
    import contextlib

    from torch.utils import _python_dispatch as dispatch

    try:
        from torch._functorch._aot_autograd.runtime_wrappers import (
            _AnalyzeCustomOpInputOutputMode as analyzer,
        )
    except ImportError:  # pragma: no cover - a torch without the analyzer
        return contextlib.nullcontext()
    if not isinstance(dispatch._get_current_dispatch_mode(), analyzer):
        return contextlib.nullcontext()
    return dispatch._pop_mode_temporarily()

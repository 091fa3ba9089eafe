"""How a compiled graph of the backend is saved and loaded.

AOTAutograd's bundled cache (``torch._functorch.config.bundled_autograd_cache``, the mega-cache
of ``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``, and the ``aot_compile``
behind ``npugraph_ex.inference.cache_compile``) stores the forward compiler's output whole when
it is an ``OutputCode``. ``SerializableCompiledGraph`` is that OutputCode around a
``CompiledGraph``: it pickles the optimized GraphModule with torch's ``GraphPickler`` (only ops
loadable wherever our packages are installed) plus the graph's plain state (input/output specs,
options, name, device), and rebuilds the CompiledGraph — hence the runtime's capture manager
with no device graph yet — on load. When the forward needs only its code and globals, those are
saved too and a load compiles them instead of rebuilding the FX graph (saved_forward.py). Captures happen again on the first call; nothing
device-specific is stored.

The AOTAutograd cache key does not know our options, so the compile runs with
``torch.compiler.config.cache_key_tag`` extended by the options hash, the pass identities and
our versions: an entry of another backend or of other options is never a hit.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import importlib.metadata
import pickle
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from npugraph_runtime.ops import forget_graph_events

from npugraph_backend import _compat, process_groups
from npugraph_backend.compiler import CompiledGraph, next_graph_name
from npugraph_backend.config import CompilerConfig
from npugraph_backend.saved_forward import LoadedGraph, saved_forward

_PASS_OPTIONS = ("post_grad_custom_pre_pass", "post_grad_custom_post_pass")
_DISTRIBUTIONS = (
    "npugraph-runtime",
    "npugraph-passes",
    "npugraph-cache",
    "npugraph-backend",
    "npugraph-ex",
    "torch_npu",
)

# Ops a saved graph may call: ATen and prims (any torch), our marker ops (registered when
# npugraph_runtime is imported, which the backend does), functional collectives, torch_npu's ops
# (imported by the NPU device) and fbgemm (as torch's own filter).
ALLOWED_OP_PREFIXES = (
    "torch.ops.aten.",
    "torch.ops.prims.",
    "torch.ops.npugraph_ex.",
    "torch.ops._c10d_functional.",
    "torch.ops.c10d_functional.",
    "torch.ops.npu.",
    "torch.ops.npu_inference.",
    "torch.ops.fbgemm.",
)


def ops_filter(name: str) -> bool:
    """True for an op a saved graph may hold (``torch.ops.<namespace>.<op>...``)."""
    return name.startswith(ALLOWED_OP_PREFIXES)


# node.meta kept in a saved graph: what a reader (readable code, error messages) uses. Fake
# tensor values ("val", "example_value", "tensor_meta") are dropped: a loaded graph runs no pass
# and its specs are stored, and a view's fake base can hold a fake mode that does not pickle.
KEPT_NODE_META = frozenset({"stack_trace", "desc", "seq_nr", "original_aten", "from_node"})


def meta_filter(key: str) -> bool:
    return key in KEPT_NODE_META


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"torch": torch.__version__}
    for dist in _DISTRIBUTIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def pass_identity(config: CompilerConfig) -> str:
    """The PassManager's identity for ``config`` (built-in passes' code and options, user passes
    by their code)."""
    from npugraph_passes import PassManager

    return str(PassManager.from_config(config).identity())


def cache_tag(config: CompilerConfig) -> str:
    """What our compile adds to torch's cache keys: options hash, pass identities, versions."""
    body = f"{config.hash()}|{pass_identity(config)}|{sorted(versions().items())}"
    return f"npugraph_ex:{hashlib.sha256(body.encode()).hexdigest()[:32]}"


@contextlib.contextmanager
def cache_key_tag(config: CompilerConfig) -> Iterator[None]:
    """Extend ``torch.compiler.config.cache_key_tag`` (public, part of every AOTAutograd and FX
    graph cache key) with ``cache_tag(config)`` for the duration of one compile."""
    base = torch.compiler.config.cache_key_tag
    tag = cache_tag(config)
    with torch.compiler.config.patch(cache_key_tag=f"{base}|{tag}" if base else tag):  # type: ignore[attr-defined]
        yield


def _portable_config(config: dict[str, Any]) -> dict[str, Any]:
    """The options a loaded graph needs. Custom passes were applied before saving and are keyed
    by their code; they are not stored (a lambda would not pickle, and a load runs no pass). A
    user pool is a live object of the compiling process: such a graph is not cacheable."""
    if config.get("use_graph_pool") is not None:
        raise _compat.bypass_cache(
            "npugraph_ex: a graph compiled with use_graph_pool (a live pool of this process) "
            "cannot be saved"
        )
    return {k: (None if k in _PASS_OPTIONS else v) for k, v in config.items()}


class SerializableCompiledGraph(_compat.OutputCode):
    """The backend's compiled forward as an AOTAutograd-cacheable OutputCode (boxed call)."""

    _boxed_call = True

    def __init__(self, compiled: CompiledGraph) -> None:
        super().__init__()
        # an instance attribute: AOTAutograd's wrappers copy __dict__, not class attributes
        self._boxed_call = True
        self.compiled: CompiledGraph | None = compiled
        self.state: bytes | None = None

    def __call__(self, inputs: Sequence[Any]) -> Any:
        compiled = self.compiled
        if compiled is None:
            raise RuntimeError(
                "npugraph_ex: a saved compiled graph was called before post_compile rebuilt it"
            )
        return compiled(list(inputs) if not isinstance(inputs, list) else inputs)

    def positional_call(self) -> Callable[..., Any] | None:
        """What a call unboxes to, taking the inputs as positional arguments (the cache's
        serving path calls it, two frames fewer a call); None before post_compile."""
        return self.compiled.positional_call() if self.compiled is not None else None

    def prepare_for_serialization(self) -> None:
        # Called on a shallow copy (AOTAutograd keeps the original running): replace our own
        # attributes only, never mutate the CompiledGraph.
        if self.compiled is None:
            return
        state = dict(self.compiled.__getstate__())
        state["config"] = _portable_config(state["config"])
        gm = state["gm"]
        if isinstance(gm, LoadedGraph):  # saved again after a load
            gm = gm.module()
        try:
            state["gm"] = _compat.graph_pickle(gm, ops_filter, meta_filter)
            # a load compiles the forward's code instead of rebuilding the graph (saved_forward)
            state["forward"] = saved_forward(gm, process_groups.group_names(gm))
            data = pickle.dumps(state)
        except Exception as exc:
            if isinstance(exc, type(_compat.bypass_cache(""))):
                raise
            raise _compat.bypass_cache(
                f"npugraph_ex: compiled graph {self.compiled.name} cannot be saved: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        self.state = data
        self.compiled = None

    def post_compile(
        self, example_inputs: Sequence[Any], constants: Any, graph_kwargs: Any
    ) -> None:
        if self.compiled is not None:
            return
        if self.state is None:
            raise RuntimeError("npugraph_ex: a saved compiled graph has no state to load")
        state = pickle.loads(self.state)
        # names (and the counters keyed by them) are per process: the saving process's
        # "graph_1" may already exist here
        name = next_graph_name()
        forward = state.pop("forward", None)
        if forward is not None and not state["config"].get("dump_tensor_data"):
            state["gm"] = LoadedGraph(forward, state["gm"])
        else:  # the data dumper walks the FX graph
            state["gm"] = _compat.graph_unpickle(state["gm"], example_inputs)
            # a warm start with a saved forward imports no pass module
            from npugraph_passes.stream_scopes import retag_graph_events

            # its events (named after the graph) are this graph's own, dropped with it; a saved
            # forward never has events (saved_forward keeps their graphs as FX)
            if retag_graph_events(state["gm"], state["name"], name):
                weakref.finalize(state["gm"], forget_graph_events, f"{name}_")
        state["name"] = name
        compiled = CompiledGraph.__new__(CompiledGraph)
        compiled.__setstate__(state)
        self.compiled = compiled

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        """No Triton kernels: the graph runs ATen ops."""

    def __repr__(self) -> str:
        return f"SerializableCompiledGraph({self.compiled!r})"


_observers: contextvars.ContextVar[tuple[Callable[[CompiledGraph], None], ...]] = (
    contextvars.ContextVar("npugraph_ex_compiled_observers", default=())
)


@contextlib.contextmanager
def observe_compiled(callback: Callable[[CompiledGraph], None]) -> Iterator[None]:
    """Call ``callback(compiled_graph)`` for every graph compiled serializably inside the block
    (the compile cache records the optimized graph's code for readable_cache)."""
    token = _observers.set((*_observers.get(), callback))
    try:
        yield
    finally:
        _observers.reset(token)


class OutputCodeCompiler:
    """Wraps a forward compiler so that AOTAutograd gets an OutputCode it can bundle."""

    def __init__(
        self, compiler: Callable[[torch.fx.GraphModule, Sequence[object]], CompiledGraph]
    ) -> None:
        self.compiler = compiler

    def __call__(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[object]
    ) -> SerializableCompiledGraph:
        compiled = self.compiler(gm, example_inputs)
        for observer in _observers.get():
            observer(compiled)
        return SerializableCompiledGraph(compiled)


def serializable_compilers(
    config: CompilerConfig,
    fw_compiler: Callable[..., Any],
    inference_compiler: Callable[..., Any],
) -> tuple[Any, Any, contextlib.AbstractContextManager[None]]:
    """(fw_compiler, inference_compiler, context) for one aot_module_simplified call, made
    inside the context. When torch asks for serializable output (bundled AOTAutograd cache,
    aot_compile), the inference compiler returns a SerializableCompiledGraph, the fw compiler is
    marked serializable so AOTAutograd looks up and saves its cache, and the context adds our
    cache tag to the key; otherwise the compilers come back unchanged with a no-op context."""
    if not _compat.serialization_wanted():
        return fw_compiler, inference_compiler, contextlib.nullcontext()
    return (
        _compat.serializable_aot_compiler(fw_compiler),
        OutputCodeCompiler(inference_compiler),
        cache_key_tag(config),
    )

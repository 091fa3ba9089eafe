"""Every private torch API the cache touches, each with the torch versions it was checked on.
A torch upgrade is a change to this file only. Checked on torch 2.11.0 too: aot_compile is not
usable there (``has_aot_compile``), so nothing past it runs; the rest is present alike."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle as _RemovableHandle

Backend = Callable[[torch.fx.GraphModule, list[Any]], Any]


# --- compile_cache.py: ahead-of-time compile, save and load of one dynamo frame ----------------
def has_aot_compile() -> bool:
    """Checked on torch 2.13.0: ``torch.compile(...).aot_compile`` (``torch._dynamo.aot_compile``)
    and the public ``torch.compiler.load_compiled_function``; both exist since torch 2.10.

    False before 2.12 (checked on 2.11.0): torch.compile attaches ``.aot_compile`` only under
    ``torch._dynamo.config.enable_aot_compile`` (off there), and with it set, aot_compile refuses
    our backend's output (it wraps only inductor's and ``AotAutograd``'s into a
    SerializableCallable, 2.12.0 any output with a ``serialize``) and cannot save a method's
    module without ``external_data``. The cache then compiles without the disk cache and says
    so (CacheWarning)."""
    if torch.__version__ < "2.12":
        return False
    try:
        import torch._dynamo.aot_compile as aot

        return hasattr(aot, "AOTCompiledFunction") and hasattr(
            torch.compiler, "load_compiled_function"
        )
    except ImportError:
        return False


def aot_compile(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    backend: Backend,
    dynamic: bool,
    value_guards: Callable[[str, str, Any], str | None] | None = None,
    recorded: list[tuple[str, str]] | None = None,
    parameter_guards: bool = True,
    specialize_float: bool = True,
) -> Any:
    """Checked on torch 2.13.0: ``torch.compile(fullgraph=True).aot_compile(((args), {kwargs}))``
    traces ``fn`` once, keeps its guards, and returns an ``AOTCompiledFunction``.

    ``specialize_float`` sets ``torch._dynamo.config.specialize_float``. Left False, dynamo
    makes Python floats graph inputs (a temperature new on every call then needs no new
    graph); where the code uses one in a way AOT's tensorify pass cannot keep symbolic
    (``math.exp(t)``, a branch on it) the pass asks for a restart with the float specialised,
    which torch.compile does but aot_compile cannot: TensorifyScalarRestartAnalysis escapes
    (``is_scalar_restart``) and the caller compiles again with specialize_float=True.

    ``value_guards(guard_type, name, value)`` gives the source to keep (or None) of each guard
    on a value; those go to ``recorded`` (they are checked by npugraph_cache.guards, since
    torch cannot save them)."""
    import functools

    import torch._dynamo.config as dynamo_config

    with dynamo_config.patch(specialize_float=specialize_float):
        compiled = torch.compile(
            fn,
            fullgraph=True,
            backend=backend,
            dynamic=dynamic,
            options={
                "guard_filter_fn": functools.partial(
                    portable_guard_filter,
                    value_guards=value_guards,
                    recorded=recorded,
                    parameter_guards=parameter_guards,
                )
            },
        )
        return compiled.aot_compile((args, kwargs))  # type: ignore[attr-defined]


def tensorified_floats(gm: torch.fx.GraphModule) -> list[str]:
    """Names of the placeholders of dynamo's graph that hold a symbolic Python float (checked on
    torch 2.13.0 with specialize_float=False: dynamo passes each as a 0-d float64 CPU tensor,
    named for its source, ``l_t_`` for the argument ``t``). A real 0-d float64 CPU tensor input
    is listed too; callers treat a listed name they do not expect as a float to specialise."""
    names = []
    for node in gm.graph.nodes:
        value = node.meta.get("example_value") if node.op == "placeholder" else None
        if (isinstance(value, torch.Tensor) and value.dim() == 0
                and value.dtype == torch.float64 and value.device.type == "cpu"):
            names.append(str(node.name))
    return names


def is_scalar_restart(exc: BaseException) -> bool:
    """Whether aot_compile failed because a symbolic float must be specialised (checked on
    torch 2.13.0: torch._dynamo.exc.TensorifyScalarRestartAnalysis, raised by AOT's
    tensorify_python_scalars, or compile_cache's own FloatsSpecialised from a backend, perhaps
    wrapped by dynamo's BackendCompilerFailed)."""
    cause: BaseException | None = exc
    while cause is not None:
        if type(cause).__name__ in ("TensorifyScalarRestartAnalysis", "FloatsSpecialised"):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


# The guard kinds torch's save refuses (identities: which function, class, module or object a
# source holds): ``CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES`` on torch 2.13.0,
# copied rather than imported (torch._dynamo.guards is not imported by a warm start; a test
# compares the two).
UNSAVABLE_GUARDS = frozenset({"DICT_VERSION", "NN_MODULE", "ID_MATCH", "FUNCTION_MATCH",
                              "CLASS_MATCH", "MODULE_MATCH", "CLOSURE_MATCH", "WEAKREF_ALIVE"})


def guard_kind(entry: Any) -> str:
    """A GuardFilterEntry's kind: its own, or the first of the kinds it is made of that torch
    cannot save (a guard made of a DICT_VERSION check, say), checked on torch 2.13.0. A type
    check on an object of a class defined in a function (``<locals>``: torch's save refuses it
    with a TypeError) is a CLASS_MATCH on ``type(<source>)``."""
    if _local_type(entry):
        return "CLASS_MATCH"
    for kind in entry.derived_guard_types:
        if kind in UNSAVABLE_GUARDS:
            return str(kind)
    return str(entry.guard_type)


def hook_registrations() -> int:
    """How many hooks were registered on any module (or anything else with a RemovableHandle)
    in this process. Checked on torch 2.13.0: every ``register_*hook`` returns a
    ``torch.utils.hooks.RemovableHandle``, whose ``__init__`` takes the class counter
    ``next_id`` and increments it."""
    return int(_RemovableHandle.next_id)


def _local_type(entry: Any) -> bool:
    return entry.guard_type == "TYPE_MATCH" and bool(entry.has_value) and (
        "<locals>" in type(entry.value).__qualname__)


def dropped_guard(
    entry: Any, parameter_guards: bool, stream_labels: frozenset[str] = frozenset()
) -> str | None:
    """Why the serving path leaves one of dynamo's guards (a GuardFilterEntry, checked on
    torch 2.13.0) out of torch's saved guard tree, or None: torch keeps and checks it on every
    call. The drop-list (docs/serving.md lists what re-checks each and the test that proves it):

    * ``identity``: a guard kind torch cannot save (``UNSAVABLE_GUARDS``): npugraph_cache.guards
      records it with a portable description and checks it on every call;
    * ``globals``: a guard rooted at the function's globals (``G[...]``, a global tensor):
      a loaded or aot-compiled function runs with a copy of its globals, which torch's tree
      would check; npugraph_cache.guards checks the live globals on every call;
    * ``parameter``: TENSOR_MATCH on an ``nn.Parameter`` with ``parameter_guards=False``: the
      compiler's runtime checks every parameter's address and layout on each call (the
      npugraph_ex capture manager), and the layouts are in the key;
    * ``hooks``: a module's hooks dict that was empty (EMPTY_NN_MODULE_HOOKS_DICT, which
      torch.compile skips by default, ``skip_nnmodule_hook_guards``): npugraph_cache.guards
      checks them all again whenever a hook was registered anywhere since
      (``hook_registrations``), one integer compare a call otherwise;
    * ``stream label``: the value of a stream's label (``stream_labels``: the sources the
      guard filter found, see ``stream_label_sources``): a label names a stream of the graph, and
      its value differs in every process; npugraph_cache.guards checks on every call which of
      the streams the code used are one stream (the aliasing pattern), the graph's meaning;
    * ``torch stream``: the TYPE_MATCH on a ``torch.Stream`` / ``torch.Event`` object (the
      sources in ``stream_labels`` as ``id(<source>)``, see ``torch_stream_guards``): torch
      saves the object as a placeholder its loaded tree's type check never matches (and cannot
      save an Event at all); npugraph_cache.guards checks its type and, with the labels, the
      aliasing pattern on every call."""
    if entry.name in stream_labels:
        return "stream label"
    if f"id({entry.name})" in stream_labels and _held_stream(entry):
        return "torch stream"
    if guard_kind(entry) in UNSAVABLE_GUARDS:
        return "identity"
    if entry.name.startswith("G[") or (entry.guard_type == "TENSOR_MATCH" and entry.is_global):
        return "globals"
    if entry.guard_type == "TENSOR_MATCH" and not parameter_guards and _is_parameter(entry):
        return "parameter"
    if entry.guard_type == "EMPTY_NN_MODULE_HOOKS_DICT":
        return "hooks"
    return None


def portable_guard_filter(
    entries: Any,
    value_guards: Callable[[str, str, Any], str | None] | None = None,
    recorded: list[tuple[str, str]] | None = None,
    parameter_guards: bool = True,
) -> list[bool]:
    """torch.compile's ``guard_filter_fn`` (a public option; entries are GuardFilterEntry,
    checked on torch 2.13.0): keep every guard but those ``dropped_guard`` names. The values
    the code read are recorded for npugraph_cache.guards (``(kind, source)`` pairs)."""
    labels = stream_label_sources(entries)
    if value_guards is not None and recorded is not None:
        for e in entries:
            held = torch_stream_guards(e.name, e.value, value_guards) if _held_stream(e) else []
            if held:
                recorded.extend(held)
                continue
            kind = STREAM_LABEL if e.name in labels else guard_kind(e)
            name, value = e.name, e.value if e.has_value else None
            if _local_type(e):
                name, value = f"type({name})", type(value)
            source = value_guards(kind, name, value)
            if source is not None:
                recorded.append((kind, source))
        # a label (or torch stream) guard is dropped only where the aliasing check will see it
        labels = frozenset(n for k, n in recorded if k == STREAM_LABEL)
    else:
        labels = frozenset()
    return [dropped_guard(e, parameter_guards, labels) is None for e in entries]


# the class attribute that names a stream object's label attribute (npugraph_runtime.Stream has
# ``__graph_stream_label__ = "label"``): a protocol, so the cache imports nothing of ours
STREAM_PROTOCOL = "__graph_stream_label__"
STREAM_LABEL = "STREAM_LABEL"  # our kind for a recorded stream label (not one of dynamo's)


def stream_label_sources(entries: Any) -> frozenset[str]:
    """The sources of the label guards of stream objects among GuardFilterEntries (checked on
    torch 2.13.0: dynamo makes a TYPE_MATCH on the object the code read, whose ``value`` is the
    object, and a CONSTANT_MATCH (EQUALS_MATCH) on ``<source>.<label attribute>``)."""
    streams: dict[str, str] = {}
    for e in entries:
        attr = getattr(type(e.value), STREAM_PROTOCOL, None) if (
            e.guard_type == "TYPE_MATCH" and e.has_value) else None
        if isinstance(attr, str) and attr.isidentifier():
            streams[e.name] = attr
    return frozenset(
        e.name for e in entries
        if e.guard_type in ("CONSTANT_MATCH", "EQUALS_MATCH") and e.has_value
        and isinstance(e.value, str)
        and any(e.name == f"{src}.{attr}" for src, attr in streams.items()))


def _is_parameter(entry: Any) -> bool:
    return bool(entry.has_value) and isinstance(entry.value, torch.nn.Parameter)


def changed_sources(compiled: Any) -> list[str]:
    """The traced source ranges of a loaded function that differ from the code installed now.
    Checked on torch 2.13.0: ``AOTCompiledFunction.source_info().inlined_sources`` (module,
    firstlineno, lastlineno, sha256 checksum of those lines)."""
    import hashlib
    import importlib
    import inspect

    changed: list[str] = []
    try:
        sources = compiled.source_info().inlined_sources
    except AttributeError:
        return changed
    for src in sources:
        where = f"{src.module} lines {src.firstlineno}-{src.lastlineno}"
        try:
            lines = inspect.getsourcelines(importlib.import_module(src.module))[0]
        except (ImportError, OSError, TypeError):
            changed.append(where)
            continue
        text = "".join(lines[src.firstlineno - 1 : src.lastlineno - 1])
        if hashlib.sha256(text.encode()).hexdigest() != src.checksum:
            changed.append(where)
    return changed


def unsavable(exc: BaseException) -> str | None:
    """Why torch's aot_compile made no function it can save, or None for any other error.
    Checked on torch 2.13.0: the backend's output refused (``BypassAOTAutogradCache``,
    ``PackageError``); torch's own AOTAutograd cache not writable in strict mode (an OSError: a
    full disk); and, with ``torch._functorch.config.enable_autograd_cache`` off, AOTAutograd's
    output without ``serialize`` ("does not implement SerializableCallable")."""
    if type(exc).__name__ in ("BypassAOTAutogradCache", "PackageError") or isinstance(exc, OSError):
        return str(exc)
    if isinstance(exc, RuntimeError) and "does not implement SerializableCallable" in str(exc):
        import torch._functorch.config as functorch_config

        if not getattr(functorch_config, "enable_autograd_cache", True):
            return ("torch._functorch.config.enable_autograd_cache is off, e.g. "
                    "TORCHINDUCTOR_AUTOGRAD_CACHE=0: AOTAutograd's output is savable only with it")
        return str(exc)
    return None


def serialize_compiled(compiled: Any) -> bytes:
    """Checked on torch 2.13.0: ``AOTCompiledFunction.serialize(fn).serialized_data``; the public
    ``save_compiled_function(path)`` writes straight to a file, we need the bytes for our format."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    data: bytes = AOTCompiledFunction.serialize(compiled, outside_modules(compiled)).serialized_data
    return data


_GLOBAL, _CELL = "global:", "closure:"


def outside_modules(compiled: Any) -> dict[str, Any]:
    """The modules the traced code read through the function's globals (``PROJ(x)`` with
    ``PROJ = nn.Linear(...)`` at module level) or its closure cells (a method of a class defined
    in a function, closing over a module), as torch's ``external_data``: ``global:<name>``,
    ``closure:<index>``. Checked on torch 2.13.0: the saved state holds a copy of the globals the
    bytecode uses (``runtime_env.used_globals``) and the function's cells
    (``runtime_env.closure``), and its pickler refuses an ``nn.Module`` that is not external data
    ("Failed to serialize"). A loaded function runs with the live globals over that copy
    (``forward_callable``'s ``extra_globals``); ``load_compiled`` binds each key to what the name
    or the cell of the function holds in the loading process, so both are the live objects, as
    the guards on them (checked on every call) expect."""
    env = getattr(compiled._artifacts, "runtime_env", None)
    found = {_GLOBAL + name: value for name, value in (getattr(env, "used_globals", None) or {}).items()
             if isinstance(value, torch.nn.Module)}
    for i, cell in enumerate(getattr(env, "closure", None) or ()):
        try:
            value = cell.cell_contents
        except (AttributeError, ValueError):  # not a cell, or an empty one
            continue
        if isinstance(value, torch.nn.Module):
            found[f"{_CELL}{i}"] = value
    return found


class _LiveObjects(dict[str, object]):
    """``external_data`` for a load: ``global:NAME`` is what ``NAME`` holds in the globals now,
    ``closure:I`` what the function's cell ``I`` holds (torch's unpickler asks ``key in``, then
    ``[key]``)."""

    def __init__(self, f_globals: dict[str, object], closure: tuple[Any, ...]) -> None:
        super().__init__()
        self.f_globals = f_globals
        self.closure = closure

    def _lookup(self, key: object) -> tuple[bool, object]:
        if isinstance(key, str) and key.startswith(_GLOBAL) and key[len(_GLOBAL):] in self.f_globals:
            return True, self.f_globals[key[len(_GLOBAL):]]
        if isinstance(key, str) and key.startswith(_CELL) and key[len(_CELL):].isdigit():
            index = int(key[len(_CELL):])
            if index < len(self.closure):
                try:
                    return True, self.closure[index].cell_contents
                except ValueError:  # an empty cell
                    pass
        return False, None

    def __contains__(self, key: object) -> bool:
        return self._lookup(key)[0]

    def __getitem__(self, key: str) -> object:
        found, value = self._lookup(key)
        if not found:
            raise KeyError(key)
        return value

    def __bool__(self) -> bool:  # torch takes ``external_data or {}``
        return True


def load_compiled(
    data: bytes, f_globals: dict[str, object], closure: tuple[Any, ...] = ()
) -> Any:
    """Public API (torch.compiler.load_compiled_function), checked on torch 2.13.0.

    Loaded inside a throwaway ``torch._guards.TracingContext``: unpickling guard sources such as
    ``ImportSource`` (a guard on ``__import__('torch').utils._pytree``, which transformers
    models produce) installs a guard into the current tracing context and fails without one."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    with tracing(TracingContext(FakeTensorMode())):
        return torch.compiler.load_compiled_function(
            io.BytesIO(data), f_globals=f_globals, external_data=_LiveObjects(f_globals, closure))


def guard_check(compiled: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Checked on torch 2.13.0: ``AOTCompiledFunction.guard_check(*args, **kwargs)`` (the frame's
    guards: tensor dtypes/shapes/strides, global state such as grad mode and thread count)."""
    return bool(compiled.guard_check(*args, **kwargs))


def guard_checker(compiled: Any) -> Callable[[tuple[Any, ...], dict[str, Any]], bool]:
    """``guard_check`` for the calls of one compiled function, cheaper on a plain positional call.
    Checked on torch 2.13.0: ``AOTCompiledFunction.guard_check`` binds the arguments with
    ``inspect.Signature.bind`` (~3 µs) into the frame locals it hands to
    ``_artifacts.guard_manager.check(f_locals)``; for a function whose parameters are all
    positional-or-keyword, without closure cells, called with every argument positionally, those
    locals are ``dict(zip(names, args))``. Any other call (keywords, defaults, a closure, another
    torch) takes torch's own path."""
    import inspect

    def general(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        return bool(compiled.guard_check(*args, **kwargs))

    artifacts = getattr(compiled, "_artifacts", None)
    manager = getattr(artifacts, "guard_manager", None)
    signature = getattr(artifacts, "signature", None)
    env = getattr(artifacts, "runtime_env", None)
    if manager is None or not isinstance(signature, inspect.Signature) or env is None:
        return general
    if getattr(env, "closure", None) or not callable(getattr(manager, "check", None)):
        return general
    params = list(signature.parameters.values())
    if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
        return general
    names = tuple(p.name for p in params)
    count, check = len(names), manager.check

    def positional(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if kwargs or len(args) != count:
            return general(args, kwargs)
        return bool(check(dict(zip(names, args, strict=True))))

    return positional


def without_first_call_alias_check() -> Any:
    """Checked on torch 2.13.0: ``torch._functorch.config.check_custom_op_aliasing`` makes the
    first invocation of an AOT runtime wrapper run ``_AnalyzeCustomOpInputOutputMode`` over every
    op (a diagnostic: do custom ops' outputs alias their inputs). On that first call our backend
    warms up and captures, so the mode sees ~10x the graph's ops (0.25 s of a 0.8 s warm start
    of a 12-layer Llama). A loaded entry's graph was checked by the process that compiled it;
    its first call skips the check (the wrapper then runs it once on a later, plain replay)."""
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "check_custom_op_aliasing"):
        import contextlib

        return contextlib.nullcontext()
    return functorch_config.patch(check_custom_op_aliasing=False)


def disable_guard_check(compiled: Any) -> None:
    """Checked on torch 2.13.0: ``AOTCompiledFunction.disable_guard_check()``; we check the guards
    ourselves first (to pick among entries), so the call itself need not check them again."""
    disable = getattr(compiled, "disable_guard_check", None)
    if disable is not None:
        disable()


def checked_elsewhere(compiled: Any) -> Callable[..., Any]:
    """What calling ``compiled`` runs once its guards were checked by the caller. Checked on
    torch 2.13.0: ``AOTCompiledFunction.__call__`` with ``disable_guard_check()`` applied does
    nothing but ``self.fn(*args, **kwargs)`` (``fn`` is dynamo's transformed function, set in
    ``__post_init__``); calling ``fn`` skips one Python frame a call. Anything else, or a
    function whose own check is still on, is called as is."""
    fn = getattr(compiled, "fn", None)
    if (type(compiled).__name__ == "AOTCompiledFunction" and callable(fn)
            and getattr(compiled, "_guard_check_enabled", True) is False
            and getattr(getattr(compiled, "_artifacts", None), "guard_manager", None) is not None):
        return fn  # type: ignore[no-any-return]
    return compiled  # type: ignore[no-any-return]


def eager_serializable(gm: torch.fx.GraphModule) -> Any:
    """Checked on torch 2.13.0: ``GraphModuleSerializableCallable`` runs the dynamo graph as is
    and pickles it with ``GraphPickler``."""
    from torch._dynamo.aot_compile_types import GraphModuleSerializableCallable

    return GraphModuleSerializableCallable(gm)


def dynamo_counters() -> Any:
    """Checked on torch 2.13.0: ``torch._dynamo.utils.counters`` (a defaultdict of Counters)."""
    from torch._dynamo.utils import counters

    return counters


def is_op(target: object) -> bool:
    """Checked on torch 2.13.0: decomposition tables are keyed by ``torch._ops.OpOverload``
    (``torch.ops.aten.relu.default``) or ``OpOverloadPacket`` (``torch.ops.aten.relu``)."""
    return isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket)


# --- rng.py: which ATen ops draw random numbers ------------------------------------------------
def is_seeded_op(target: object) -> bool:
    """Checked on torch 2.13.0: ``torch._ops.OpOverload(Packet)`` and their ``tags``; an op tagged
    ``nondeterministic_seeded`` reads the RNG state."""
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    if isinstance(target, torch._ops.OpOverloadPacket):
        return any(
            torch.Tag.nondeterministic_seeded in getattr(target, name).tags
            for name in target.overloads()  # type: ignore[no-untyped-call]
        )
    return False


def function_globals(compiled: Any) -> dict[str, Any] | None:
    """The globals a compiled function runs with: checked on torch 2.13.0, an
    ``AOTCompiledFunction``'s ``fn`` runs with a dict of its own (a copy made when it was
    compiled or loaded, ``GraphRuntimeEnv.forward_callable``), so a global the traced code
    assigns never reaches the user's module. None for anything else (an uncached function)."""
    fn = getattr(compiled, "fn", None)
    own = getattr(fn, "__globals__", None)
    return own if isinstance(own, dict) and type(compiled).__name__ == "AOTCompiledFunction" \
        else None


def traced_here() -> bool:
    """Checked on torch 2.13.0 and 2.11: the calling code is traced by a compile running in this
    thread. torch sets ``torch.compiler.is_compiling()``'s flag for the whole process during a
    compile session, so it alone is True in other threads too; dynamo folds
    ``is_dynamo_compiling()`` to True in what it traces, and the rest of the session (AOT, the
    backend) runs under a per-thread ``CompileContext``."""
    return torch.compiler.is_dynamo_compiling() or (
        torch.compiler.is_compiling() and torch._guards.CompileContext.try_get() is not None)


# --- a torch.Stream / torch.Event the traced code read (see dropped_guard: "torch stream") ----
def _held_stream(entry: Any) -> bool:
    """A TYPE_MATCH on a torch.Stream or torch.Event (torch.cuda's / torch.npu's too: they
    subclass them on a build with that device). Checked on torch 2.13.0: dynamo guards such an object with a TYPE_MATCH only
    (``VariableBuilder``: the graph fetches the live object by index on every call), and the
    guard save pickles a Stream as ``_Missing("unsupported")`` (``_get_unsupported_types``),
    so the loaded tree's TYPE_MATCH fails on every call, and an Event not at all (TypeError)."""
    return entry.guard_type == "TYPE_MATCH" and bool(entry.has_value) and isinstance(
        entry.value, torch.Stream | torch.Event)


def torch_stream_guards(
    name: str, value: Any, value_guards: Callable[[str, str, Any], str | None]
) -> list[tuple[str, str]]:
    """What replaces the TYPE_MATCH on a torch stream or event at ``name``: its type (a
    CLASS_MATCH on ``type(<name>)``) and its identity as a stream label (``id(<name>)``, in the
    aliasing pattern: which of the streams and events the code used are one object, as dynamo
    gives one index to one object). Both or neither (the guard is then kept)."""
    kept = [(kind, value_guards(kind, source, v)) for kind, source, v in (
        ("CLASS_MATCH", f"type({name})", type(value)), (STREAM_LABEL, f"id({name})", id(value)))]
    if any(source is None for _, source in kept):
        return []
    return [(kind, source) for kind, source in kept if source is not None]

"""cache_compile: compile a module's method once, keep it on disk, load it in later processes.

The first process traces the method with dynamo (fullgraph), compiles it with the given backend
and saves torch's ahead-of-time compiled function, guards included, into our versioned format.
Later processes load it: no dynamo tracing, no AOT autograd, no passes; the guards still check
every call, and a call the entries' guards reject compiles (and saves) a new entry.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import functools
import inspect
import logging
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from npugraph_cache import _compat
from npugraph_cache.__about__ import __version__
from npugraph_cache.entries import EntryReader, bump
from npugraph_cache.errors import (
    CacheArgumentError,
    CachePermissionError,
    CacheTypeError,
    CacheWarning,
    describe,
)
from npugraph_cache.format import encode
from npugraph_cache.guards import ValueGuards
from npugraph_cache.keys import (
    CacheKey,
    build_key,
    model_info,
    rank_component,
    stable_value,
    value_signature,
)
from npugraph_cache.rng import RngGraphError, refuse_rng
from npugraph_cache.store import CacheStore, check_owned
from npugraph_cache.variants import load_any

# the npugraph_ex logger (TORCH_LOGS=+npugraph_ex once the backend registered it)
log = logging.getLogger("npugraph_ex")

__all__ = ["Backend", "CacheCompiledFunction", "CacheWarning", "CompileFn", "EntryData",
           "cache_compile", "check_cache_dir", "check_decompositions", "eager_compile_fn"]

Backend = Callable[[torch.fx.GraphModule, list[Any]], Any]
CompileFn = Callable[[Mapping[str, Any] | None, Mapping[Any, Any] | None], Backend]

_ALLOWED_KWARGS = ("options", "custom_decompositions")
_USER_KEYWORDS = ("dynamic", "cache_dir", "global_rank", "tp_rank", "pp_rank")


@dataclasses.dataclass(frozen=True)
class EntryData:
    """What the compiler learns on a fresh entry's first call (for npugraph_ex: the capture's
    kernel decisions) and wants back before a loaded entry's first call, as plain JSON data.
    ``export()`` is called after the first call of a freshly compiled entry and stored in the
    entry's authenticated metadata; ``seed(data)`` gets it back when an entry is loaded (a
    ValueError there is a CacheWarning, and the entry is still used)."""

    export: Callable[[], Any]
    seed: Callable[[Any], object]


def eager_compile_fn(
    options: Mapping[str, Any] | None, custom_decompositions: Mapping[Any, Any] | None
) -> Backend:
    """The torch-only default: run the dynamo graph as traced (no AOT, no passes)."""
    if options:
        raise CacheArgumentError(
            f"cache_compile: options={dict(options)!r} need a compile_fn that understands them; "
            "the default compile_fn runs the traced graph as is (use npugraph_ex.inference."
            "cache_compile for the npugraph_ex backend)"
        )
    if custom_decompositions:
        raise CacheArgumentError(
            "cache_compile: custom_decompositions need a compile_fn that applies them; the "
            "default compile_fn does not decompose"
        )
    return _eager_backend


def _eager_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    return _compat.eager_serializable(gm)


class _Uncached:
    """A function compiled by plain torch.compile (dynamo keeps its own guards and recompiles)."""

    def __init__(self, compiled: Callable[..., Any]) -> None:
        self.compiled = compiled

    def guard_check(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)


class FloatsSpecialised(Exception):
    """A compile with symbolic floats found one to specialise: one the traced code computes
    with on the host, or one that is not an argument of the call (a module attribute or a
    global, whose changes only a specialised entry's value guards see), or a graph on an
    accelerator (whose capture would keep the CPU scalar's value of the capture)."""


def _guarded_by_torch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """The value check of an entry torch.compile runs: dynamo guards those values itself."""
    return True


def _detached(qualname: str) -> Callable[..., Any]:
    def detached(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"this copy of cache_compile({qualname}) was unpickled or deep-copied and is detached "
            "from its module and cache; call cache_compile again on the new module's method"
        )

    return detached


class _Entry:
    """One entry in use: what selects it for a call (value signature, value guards, kept
    guards) and the compiled function, called with its guards on every call."""

    __slots__ = ("compiled", "guards_pass", "run", "signature", "training", "values_match")
    compiled: Any
    run: Callable[..., Any]

    def __init__(
        self, signature: tuple[Any, ...], compiled: Any,
        values_match: Callable[[tuple[Any, ...], dict[str, Any]], bool],
        guards_pass: Callable[[tuple[Any, ...], dict[str, Any]], bool], training: bool,
    ) -> None:
        self.signature = signature
        # the module's mode when the entry was made: module attributes are not re-checked on
        # every call, but train()/eval() is (one attribute read; BatchNorm and dropout read it)
        self.training = training
        self.values_match = values_match
        self.guards_pass = guards_pass
        self.replace(compiled)

    def replace(self, compiled: Any) -> None:
        """Serve with ``compiled`` from now on; ``run`` is what a call whose guards passed
        runs (the compiled function without its own second guard check)."""
        self.compiled = compiled
        self.run = _compat.checked_elsewhere(compiled)


class CacheCompiledFunction:
    """The callable cache_compile returns. Calls run under ``torch.no_grad()`` (inference only).

    Pickling it (dynamo pickles a module's attributes when it saves guards; so do deepcopy and
    torch.save) gives a detached stub, never the compiled entries or the cache settings."""

    def __init__(
        self,
        func: Callable[..., Any],
        *,
        dynamic: bool,
        store: CacheStore,
        rank: Callable[[], str],
        options: Mapping[str, Any] | None,
        custom_decompositions: Mapping[Any, Any] | None,
        compile_fn: CompileFn,
        key_extra: Mapping[str, Any] | None,
        entry_data: EntryData | None = None,
        parameter_guards: bool = True,
    ) -> None:
        self._method = func
        self._module: torch.nn.Module = func.__self__  # type: ignore[attr-defined]
        self._function: Callable[..., Any] = func.__func__  # type: ignore[attr-defined]
        self.name: str = self._function.__name__
        self.dynamic = dynamic
        self.store = store
        self._rank = rank
        self.options = dict(options) if options is not None else None
        self.custom_decompositions = custom_decompositions
        self.compile_fn = compile_fn
        self.key_extra = dict(key_extra or {})
        self.entry_data = entry_data
        self.parameter_guards = parameter_guards
        # dynamic: Python floats are graph inputs (a temperature new on every call reuses the
        # entry) until a compile finds one the code must specialise; then one entry per value
        self._float_values = not dynamic
        # (path, metadata, payload) of an entry written before its first call
        self._unfinished: tuple[Path, dict[str, Any], bytes] | None = None
        # a miss (compile or load, then the entry's first call) runs in one thread at a time: a
        # thread that waited finds the entry the other made instead of compiling or loading its
        # own copy, and _unfinished belongs to the entry whose first call finishes it
        self._miss_lock = threading.RLock()
        self._entries: list[_Entry] = []
        self._self_name: str = self._function.__code__.co_varnames[0]
        self._signature = inspect.signature(self._function)
        self._params = tuple(self._signature.parameters)
        # a call giving every parameter positionally binds by position: no Signature.bind
        self._positional_arity = len(self._params) if all(
            p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
            for p in self._signature.parameters.values()) else -1
        self.entry_paths: list[Path] = []
        self.__wrapped__ = func
        self.__doc__ = getattr(func, "__doc__", None)

    def _frame(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The method's parameters' values for a call (the module first, defaults applied), as
        dynamo's guards name them."""
        if not kwargs and len(args) + 1 == self._positional_arity:
            return (self._module, *args)
        bound = self._signature.bind(self._module, *args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments[p] for p in self._params)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_detached, (getattr(self._function, "__qualname__", self.name),))

    @property
    def rank(self) -> str:
        """This process's rank component, read on each miss, not at cache_compile: a model that
        wraps its methods in ``__init__`` may be built before ``init_process_group``, and its
        ranks must still get folders and keys of their own (a graph may hold the rank)."""
        return self._rank()

    @property
    def func_dir(self) -> Path:
        """Computed when needed: the module may still be under construction when it wraps its
        own methods in __init__."""
        return self.store.func_dir(model_info(self._module, self.dynamic), self.rank, self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():  # a server's loop usually runs under no_grad already
            with torch.no_grad():
                return self._call(args, kwargs)
        return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        signature = value_signature(args, kwargs, self.dynamic, self._float_values)
        call_args = (self._module, *args)
        entry = self._select(signature, args, call_args, kwargs)
        if entry is not None:
            return entry.run(*call_args, **kwargs)
        with self._miss_lock:
            return self._miss(signature, args, kwargs)

    def _select(self, signature: tuple[Any, ...], args: tuple[Any, ...],
                call_args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Entry | None:
        """The first entry in use whose value signature, mode, value guards and torch's guard
        tree accept the call (each evaluated once), or None."""
        training = self._module.training
        for entry in self._entries:
            if (entry.signature == signature and entry.training is training
                    and entry.values_match(args, kwargs)
                    and entry.guards_pass(call_args, kwargs)):
                return entry
        return None

    def guard_check(self, *args: Any, **kwargs: Any) -> bool:
        """Whether an entry in use serves this call as it is, without a load or a compile: its
        value signature, the value guards of ``npugraph_cache.guards`` and torch's guard tree
        accept it (what every call evaluates before it runs an entry; bench (a) times it).
        Evaluated under ``torch.no_grad()``, as the call runs."""
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self.guard_check(*args, **kwargs)
        signature = value_signature(args, kwargs, self.dynamic, self._float_values)
        return self._select(signature, args, (self._module, *args), kwargs) is not None

    def _miss(self, signature: tuple[Any, ...], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Any:
        call_args = (self._module, *args)
        training = self._module.training
        found = self._select(signature, args, call_args, kwargs)  # one another thread added
        if found is not None:
            return found.run(*call_args, **kwargs)
        try:
            compiled, guards, loaded = self._obtain(args, kwargs)
        except FloatsSpecialised:
            self._float_values = True
            signature = value_signature(args, kwargs, self.dynamic, True)
            compiled, guards, loaded = self._obtain(args, kwargs)
        check = guards.checker(self._function.__globals__, self._module, self._frame)
        entry = _Entry(signature, compiled, check, _compat.guard_checker(compiled), training)
        self._entries.append(entry)
        # the entry's own copy of its globals (a loaded or aot-compiled function's): what the
        # first call assigns there is the user's state, as eager would have left it
        own_globals = _compat.function_globals(compiled)
        before = dict(own_globals) if own_globals is not None else {}
        if loaded:
            with _compat.without_first_call_alias_check():
                out = compiled(*call_args, **kwargs)
        else:
            out = compiled(*call_args, **kwargs)
            self._finish_entry()
        changed = self._globals_assigned(before, own_globals) or guards.changed(
            self._function.__globals__, self._frame(args, kwargs))
        if changed is None and not entry.guards_pass(call_args, kwargs):
            changed = "the call itself fails the guards it passed (an attribute or container " \
                      "it read and updated)"
        if changed is not None:  # the call changed what the entry was traced with
            entry.replace(self._state_writer(f"changed a value its graph was traced with "
                                             f"({changed})"))
            entry.values_match = _guarded_by_torch
            entry.guards_pass = _compat.guard_checker(entry.compiled)
        return out

    def _globals_assigned(self, before: dict[str, Any],
                          own_globals: dict[str, Any] | None) -> str | None:
        """The globals of the method's module that its entry's first call assigned or deleted
        in the entry's copy of them (``global STEP; STEP += 1``), written back to the module
        (the first call's effect, as eager's), described; None when there are none."""
        if own_globals is None:
            return None
        user = self._function.__globals__
        assigned = [name for name in user
                    if name in before and own_globals.get(name, before) is not before[name]]
        for name in assigned:
            if name in own_globals:
                user[name] = own_globals[name]
            else:
                del user[name]
        return f"assigns the global {assigned[0]!r}" if assigned else None

    def _state_writer(self, what: str) -> _Uncached:
        """A method that updates Python state it reads (``self.calls += 1``, a list it appends
        to, a lazily allocated cache): a cached entry would replay the value of its trace on
        every call (the entry's guards on module attributes are not re-checked, and its globals
        are a copy), so this process compiles it with torch.compile, whose guards follow the
        value, as eager does: with automatic dynamic shapes and without fullgraph (past dynamo's
        recompile limit, say for a counter, it runs eagerly rather than raise)."""
        warnings.warn(
            f"npugraph_ex cache: {self.name} {what}: a cached entry would repeat the value it was "
            "traced with on every call; this process compiles it with torch.compile instead, "
            "without the disk cache. Keep such state in a tensor buffer, or pass it as an "
            "argument",
            CacheWarning,
            stacklevel=4,
        )
        bump("state_writers")
        return self._compile_without_cache(fullgraph=False, automatic_dynamic=True)

    def _finish_entry(self) -> None:
        """Rewrite the entry just compiled with what its first call taught the compiler."""
        unfinished, self._unfinished = self._unfinished, None
        if unfinished is None or self.entry_data is None:
            return
        path, metadata, payload = unfinished
        try:
            metadata = {**metadata, "entry_data": self.entry_data.export()}
            data = encode(metadata, payload, self.store.key)
            with self.store.lock(path.parent):
                self.store.write(path, data)
        except Exception as exc:  # the entry as first written stays valid
            warnings.warn(
                f"npugraph_ex cache: {self.name}: could not add the first call's data to {path} "
                f"({type(exc).__name__}: {exc}); a warm start decides it again",
                CacheWarning,
                stacklevel=3,
            )

    def _seed(self, path: Path, data: Any) -> None:
        if self.entry_data is None or data is None:
            return
        try:
            self.entry_data.seed(data)
        except ValueError as exc:
            warnings.warn(
                f"npugraph_ex cache: {path}: its first-call data is ignored ({exc})",
                CacheWarning,
                stacklevel=4,
            )

    # --- obtaining an entry -------------------------------------------------------------------
    def key_for(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> CacheKey:
        return build_key(
            self._method,
            self._module,
            args,
            kwargs,
            dynamic=self.dynamic,
            options=self.options,
            custom_decompositions=self.custom_decompositions,
            rank=self.rank,
            key_extra=self.key_extra,
            float_values=self._float_values,
        )

    def _obtain(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, ValueGuards, bool]:
        """(compiled, the value guards it must keep passing, whether it was loaded)."""
        no_guards = ValueGuards(self._self_name, (), (), self._params)
        if not _compat.has_aot_compile():
            warnings.warn(
                f"npugraph_ex cache: torch {torch.__version__} has no aot_compile; {self.name} "
                "is compiled without the disk cache",
                CacheWarning,
                stacklevel=3,
            )
            return self._compile_without_cache(), no_guards, False
        key = self.key_for(args, kwargs)
        func_dir = self.func_dir
        call_args = (self._module, *args)
        reader = EntryReader(
            self.store, self._self_name, self._function.__globals__, self._frame, self._seed,
            self._function.__closure__ or (),
        )
        loaded = True
        try:
            self.store.ensure_dir(func_dir)
            compiled, guards, path = load_any(reader, func_dir, key, call_args, kwargs)
            if compiled is None:
                # Writers queue here; whoever comes second finds the first one's entry, loads it.
                with self.store.lock(func_dir):
                    compiled, guards, path = load_any(reader, func_dir, key, call_args, kwargs)
                    if compiled is None:
                        if reader.stale:
                            reader.reject(
                                f"npugraph_ex cache: {self.name}: {reader.stale[0]}; recompiling"
                            )
                        compiled, guards = self._compile_and_save(path, key, args, kwargs)
                        loaded = False
        except (CachePermissionError, OSError) as exc:  # OSError: a read-only or full disk
            reason = str(exc) if isinstance(exc, CachePermissionError) else (
                f"cannot use the cache folder {func_dir} ({type(exc).__name__}: {exc})")
            warnings.warn(
                f"npugraph_ex cache: {reason}; {self.name} is compiled without the disk cache",
                CacheWarning,
                stacklevel=3,
            )
            return self._compile_without_cache(), no_guards, False
        _compat.disable_guard_check(compiled)
        if not isinstance(compiled, _Uncached) and path.is_file():  # else: not saved (warned)
            self.entry_paths.append(path)
            # TORCH_LOGS=+npugraph_ex: which entry a call got (`npugraph-ex cache show PATH`)
            log.info("cache: %s %s %s", self.name, "loaded" if loaded else "compiled and saved",
                     path)
        return compiled, guards, loaded

    def _compile_and_save(
        self, path: Path, key: CacheKey, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, ValueGuards]:
        backend = self.compile_fn(self.options, self.custom_decompositions)
        graph_code: list[str] = []
        recorded: list[tuple[str, str]] = []
        self_name = self._self_name
        params = self._params
        qualname = getattr(self._function, "__qualname__", self.name)

        float_args = set() if self._float_values else self._float_arguments(args, kwargs)
        symbolic = bool(float_args)  # else floats specialised, keyed by value (keys.input_spec)

        def checked_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            if symbolic:
                floats = _compat.tensorified_floats(gm)
                if floats and (not set(floats) <= float_args or any(
                        isinstance(t, torch.Tensor) and t.device.type != "cpu"
                        for t in example_inputs)):
                    raise FloatsSpecialised(", ".join(floats))
            refuse_rng(gm, qualname)
            graph_code.append(gm.print_readable(print_output=False))
            return backend(gm, example_inputs)

        try:
            compiled = _compat.aot_compile(
                self._method,
                args,
                kwargs,
                checked_backend,
                self.dynamic,
                value_guards=lambda kind, name, value: ValueGuards.kept(kind, name, params, value),
                recorded=recorded,
                parameter_guards=self.parameter_guards,
                specialize_float=not symbolic,
            )
        except Exception as exc:
            if symbolic and _compat.is_scalar_restart(exc):
                raise FloatsSpecialised(str(exc)) from None
            cause: BaseException | None = exc
            while cause is not None:
                if isinstance(cause, RngGraphError):
                    raise RngGraphError(str(cause)) from None
                why = _compat.unsavable(cause)
                if why is not None:
                    # The backend's output cannot be saved (torch's aot_compile insists): compile
                    # normally, without the disk cache, rather than fail.
                    warnings.warn(
                        f"npugraph_ex cache: {qualname} cannot be saved ({why}); this process "
                        "compiles it without the disk cache",
                        CacheWarning,
                        stacklevel=4,
                    )
                    return self._compile_without_cache(), ValueGuards(self_name, (), ())
                cause = cause.__cause__ or cause.__context__
            raise
        bump("compiled")
        guards = ValueGuards.from_recorded(
            recorded, params, self._function.__globals__, self._frame(args, kwargs)
        )
        readable = getattr(backend, "readable_code", None)
        metadata = {
            "key": key.fields,
            "key_digest": key.digest(),
            "func": qualname,
            "module_class": key.fields["module_class"],
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "npugraph_cache": __version__,
            "options": stable_value(self.options or {}),
            "input_spec": key.fields["input_spec"],
            "dynamic": self.dynamic,
            "rank": self.rank,
            "graph_code": "\n".join(graph_code),
            "compiler_code": str(readable()) if callable(readable) else "",
            "value_guards": guards.to_json(),
        }
        try:
            payload = _compat.serialize_compiled(compiled)
            self.store.write(path, encode(metadata, payload, self.store.key))
        except Exception as exc:  # a backend output that does not pickle; a full disk
            warnings.warn(
                f"npugraph_ex cache: {qualname} compiled but cannot be saved to {path} "
                f"({type(exc).__name__}: {exc}); this process uses it without the disk cache",
                CacheWarning,
                stacklevel=4,
            )
            return compiled, guards
        self._unfinished = (path, metadata, payload)
        return compiled, guards

    def _float_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[str]:
        """dynamo's placeholder names of the call's float arguments (``l_t_`` for ``t``)."""
        try:
            bound = inspect.signature(self._function).bind(self._module, *args, **kwargs)
        except TypeError:
            return set()
        return {f"l_{name}_" for name, value in bound.arguments.items() if type(value) is float}

    def _compile_without_cache(
        self, fullgraph: bool = True, automatic_dynamic: bool = False
    ) -> _Uncached:
        """torch.compile of the method with this cache's backend, options and ``dynamic``;
        ``automatic_dynamic``: where the cache is static, dynamo's automatic dynamic shapes
        instead (``dynamic=None``)."""
        backend = self.compile_fn(self.options, self.custom_decompositions)
        dynamic = (self.dynamic or None) if automatic_dynamic else self.dynamic
        compiled = torch.compile(
            self._function, fullgraph=fullgraph, backend=backend, dynamic=dynamic
        )
        return _Uncached(compiled)


def cache_compile(
    func: Callable[..., Any],
    *,
    dynamic: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    global_rank: int | None = None,
    tp_rank: int | None = None,
    pp_rank: int | None = None,
    compile_fn: CompileFn | None = None,
    key_extra: Mapping[str, Any] | None = None,
    entry_data: EntryData | None = None,
    parameter_guards: bool = True,
    **kwargs: Any,
) -> CacheCompiledFunction:
    """Compile ``func`` (a bound method of an ``nn.Module``) once and cache it on disk.

    The user guarantees: ``func`` is traceable as one graph (fullgraph), draws no random numbers
    (refused with RngGraphError), is not itself decorated or ``torch.compile``-d, and each method
    holds one phase (write prompt and decode as separate methods). Calls run under no_grad.
    Entries live in ``<cache_dir>/<model_info>/[world<W>global_rank<R>/]<func>/`` (default
    cache_dir ``.npugraph_ex_cache``). ``compile_fn(options, custom_decompositions)`` returns the
    dynamo backend (its result must be serializable by torch's aot_compile); ``key_extra`` is
    what that backend adds to the key (versions, options hash, pass identities);
    ``entry_data`` what it learns on an entry's first call and wants back on a load;
    ``parameter_guards=False`` (for a compile_fn whose runtime checks parameter addresses
    itself, and which puts that choice in key_extra) keeps no per-call guard on parameters.
    Every call runs torch's compiled function (its guard tree, then dynamo's bytecode).
    kwargs: ``options=`` and ``custom_decompositions=`` only.
    """
    unknown = sorted(set(kwargs) - set(_ALLOWED_KWARGS))
    if "direct_dispatch" in unknown:
        raise CacheArgumentError(
            f"cache_compile: direct_dispatch={kwargs['direct_dispatch']!r}: the option was "
            "removed; every call runs torch's compiled function with its guards (no flat-argument "
            "plan), so leave it out"
        )
    if unknown:
        # every keyword a user may pass, not just the two **kwargs: a typo of cache_dir must
        # not read as "cache_dir is not allowed"
        allowed = [*_USER_KEYWORDS, *_ALLOWED_KWARGS]
        close = difflib.get_close_matches(unknown[0], allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise CacheArgumentError(
            f"cache_compile: unknown keyword argument(s) {', '.join(map(repr, unknown))}{hint}; "
            f"allowed: {', '.join(allowed)}"
        )
    if not inspect.ismethod(func):
        raise CacheArgumentError(
            f"cache_compile: func must be a bound method of an nn.Module (e.g. model.decode), "
            f"got {type(func).__name__} {func!r}"
        )
    if not isinstance(func.__self__, torch.nn.Module):
        raise CacheArgumentError(
            f"cache_compile: func must be a method of an nn.Module, got a method of "
            f"{type(func.__self__).__name__}"
        )
    if not isinstance(dynamic, bool):
        raise CacheArgumentError(
            f"cache_compile: dynamic must be True or False, got {describe(dynamic)}"
        )
    for name, value in (("global_rank", global_rank), ("tp_rank", tp_rank), ("pp_rank", pp_rank)):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            raise CacheArgumentError(
                f"cache_compile: {name} must be an int >= 0 or None, got {describe(value)}"
            )
    options = kwargs.get("options")
    if options is not None and not isinstance(options, Mapping):
        raise CacheArgumentError(
            f"cache_compile: options must be a dict or None, got {describe(options)}"
        )
    decompositions = kwargs.get("custom_decompositions")
    check_decompositions(decompositions)
    store = CacheStore(check_cache_dir(cache_dir))
    store.key  # noqa: B018 - a missing key is created now, a bad key file refused at this call
    return CacheCompiledFunction(
        func,
        dynamic=dynamic,
        store=store,
        rank=functools.partial(rank_component, global_rank, tp_rank, pp_rank),
        options=options,
        custom_decompositions=decompositions,
        compile_fn=compile_fn or eager_compile_fn,
        key_extra=key_extra,
        entry_data=entry_data,
        parameter_guards=parameter_guards,
    )


def check_cache_dir(cache_dir: object) -> str | os.PathLike[str] | None:
    """cache_dir as given, or CacheTypeError / CacheArgumentError / CachePermissionError naming
    it: a path (str or os.PathLike) of a folder of ours that others cannot write to, or None."""
    if cache_dir is None:
        return None
    if not isinstance(cache_dir, str | os.PathLike) or isinstance(cache_dir, bytes):
        raise CacheTypeError(
            f"cache_compile: cache_dir must be a folder path (str or os.PathLike) or None, got "
            f"{describe(cache_dir)}"
        )
    path = Path(cache_dir)
    if not str(cache_dir):
        raise CacheArgumentError(
            "cache_compile: cache_dir must be a folder path or None, got an empty string"
        )
    if path.is_symlink() or path.exists():
        if not path.is_symlink() and not path.is_dir():
            raise CacheArgumentError(
                f"cache_compile: cache_dir {str(path)!r} exists and is not a folder; give a "
                "folder (created when missing) or None"
            )
        check_owned(path, "cache_compile: cache_dir")
    return cache_dir


def check_decompositions(decompositions: object) -> None:
    """CacheTypeError unless None or a dict {ATen op: callable}, naming the first bad item."""
    if decompositions is None:
        return
    if not isinstance(decompositions, Mapping):
        raise CacheTypeError(
            "cache_compile: custom_decompositions must be a dict {op: function} or None, got "
            f"{describe(decompositions)}"
        )
    for op, fn in decompositions.items():
        if not _compat.is_op(op):
            raise CacheTypeError(
                f"cache_compile: custom_decompositions key {describe(op)} is not an ATen op; "
                "allowed keys: an OpOverload such as torch.ops.aten.relu.default or a packet "
                "such as torch.ops.aten.relu"
            )
        if not callable(fn):
            raise CacheTypeError(
                f"cache_compile: custom_decompositions[{op}] is {describe(fn)}, not callable; "
                "allowed values: a function taking the op's arguments"
            )

"""The pass manager: an ordered, option-gated list of graph passes and a fixed clean-up tail.

A pass is ``fn(gm, example_inputs, config) -> None`` that rewrites ``gm.graph`` in place. The
manager times each pass, tells an observer (the debug dumper) after each one, and wraps any
exception in a :class:`PassError` that names the pass. The built-ins' one-time work of a process
(importing their modules, inductor's no-op table, registering the fusion rules) is done before
the first pass is timed and logged as a line of its own, so that a pass's time is its own.
"""

from __future__ import annotations

import importlib
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from npugraph_passes.errors import PassConfigError, PassError
from npugraph_passes.identity import combine, options_digest, package_digest, source_digest

log = logging.getLogger("npugraph_ex")

PassFn = Callable[[torch.fx.GraphModule, Sequence[Any], Any], None]
Observer = Callable[[str, torch.fx.GraphModule, "PassRecord"], None]

#: Built-in passes in the order they run, each gated by the option of the same name (default on).
BUILTIN_OPTIONS: tuple[str, ...] = (
    "remove_noop_ops",
    "pattern_fusion_pass",
    "remove_cat_ops",
    "inplace_pass",
    "input_inplace_pass",
)
USER_PASS_OPTIONS: tuple[str, ...] = ("post_grad_custom_pre_pass", "post_grad_custom_post_pass")


@dataclass(frozen=True)
class PassRecord:
    """What one pass did: wall time and whether (and how much) it changed the graph."""

    name: str
    seconds: float
    changed: bool
    nodes_before: int
    nodes_after: int


class GraphPass:
    """A named pass with a stable identity.

    ``options`` are the names and values of the options the pass reads; they are part of the
    identity. ``builtin`` passes hash every source file of npugraph_passes (their helpers are
    shared); user passes hash their own source, defaults and closed-over values (or bytecode when
    there is no source, or their own ``identity()``/``uuid()``).
    """

    def __init__(
        self,
        fn: PassFn,
        name: str | None = None,
        options: Mapping[str, object] | None = None,
        *,
        builtin: bool = False,
    ) -> None:
        if not callable(fn):
            raise PassConfigError(f"a graph pass must be callable (gm, example_inputs, config); got {fn!r}")
        self.fn = fn
        self.name: str = name or str(getattr(fn, "__name__", type(fn).__name__))
        self.options: dict[str, object] = dict(options or {})
        self.builtin = builtin
        self._identity: str | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
        self.fn(gm, example_inputs, config)

    def identity(self) -> str:
        if self._identity is None:
            code = package_digest() if self.builtin else source_digest(self.fn)
            self._identity = combine(self.name, code, options_digest(self.options))
        return self._identity

    def __repr__(self) -> str:
        return f"GraphPass({self.name!r}, options={self.options!r})"


def _fingerprint(graph: torch.fx.Graph) -> int:
    items: list[object] = []
    for node in graph.nodes:
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.name)
        items.append((node.name, node.op, str(node.target), repr(args)))
    return hash(tuple(items))


def _count(graph: torch.fx.Graph) -> int:
    return len(graph.nodes)


# The built-in passes' modules, by the option that enables them. A warm start only needs the
# manager's identity (for the cache key), which hashes the package's sources, never the pass
# objects: so a pass's module is imported when the pass first runs.
_BUILTIN_MODULES: dict[str, str] = {
    "remove_noop_ops": "npugraph_passes.noop",
    "remove_cat_ops": "npugraph_passes.cat",
    "inplace_pass": "npugraph_passes.reinplace",
    "input_inplace_pass": "npugraph_passes.reinplace",
    "pattern_fusion_pass": "npugraph_passes.fusion",
    "lower_auto_functionalized": "npugraph_passes.reinplace",
    "dead_code_elimination": "npugraph_passes.cleanup",
    "capture_safety_lint": "npugraph_passes.lint",
}

# What a built-in pass does once per process on its first call besides importing its module:
# a function of that module, called with no arguments before any pass is timed.
_BUILTIN_SETUP: dict[str, str] = {
    "remove_noop_ops": "noop_rules",  # imports inductor's post_grad for its no-op table (~2 s)
    "pattern_fusion_pass": "ensure_builtin_patterns",  # traces and registers the rules
}
_SET_UP: set[str] = set()  # the built-ins whose one-time work this process has done


class _BuiltinPass:
    """A built-in pass imported on its first call (see _BUILTIN_MODULES)."""

    def __init__(self, name: str) -> None:
        self.__name__ = name
        self._fn: PassFn | None = None

    def resolve(self) -> PassFn:
        if self._fn is None:
            fn: PassFn = getattr(importlib.import_module(_BUILTIN_MODULES[self.__name__]), self.__name__)
            self._fn = fn
        return self._fn

    def set_up(self) -> bool:
        """Does the pass's one-time work of this process; True when it was not done before."""
        self.resolve()
        if self.__name__ in _SET_UP:
            return False
        setup = _BUILTIN_SETUP.get(self.__name__)
        if setup is not None:
            getattr(sys.modules[_BUILTIN_MODULES[self.__name__]], setup)()
        _SET_UP.add(self.__name__)
        return True

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
        self.resolve()(gm, example_inputs, config)

    def __repr__(self) -> str:
        return f"<built-in pass {_BUILTIN_MODULES[self.__name__]}.{self.__name__}>"


def _builtin_pass(option: str) -> PassFn:
    if option not in _BUILTIN_MODULES:
        raise ValueError(f"unknown built-in pass {option!r}; allowed: {', '.join(BUILTIN_OPTIONS)}")
    return _BuiltinPass(option)


def _user_rule_digests() -> tuple[str, ...]:
    # Rules can only be registered through npugraph_passes.fusion, so none exist while it is not
    # imported (a warm start's key must not pay for importing it).
    fusion = sys.modules.get("npugraph_passes.fusion")
    if fusion is None:
        return ()
    digests: tuple[str, ...] = fusion.user_rule_digests()
    return digests


def _check_bool(option: str, value: object) -> bool:
    if type(value) is not bool:
        raise PassConfigError(f"option {option}={value!r} must be True or False")
    return value


def _check_user_pass(option: str, value: object) -> PassFn | None:
    if value is None:
        return None
    if not callable(value):
        raise PassConfigError(
            f"option {option}={value!r} must be a callable (gm, example_inputs, config) -> None or None"
        )
    return value  # type: ignore[no-any-return]


class PassManager:
    """Runs, in order: the user's pre pass, the enabled built-ins, the user's post pass, then the
    fixed tail (lowering of functionalized custom ops, dead-code elimination, capture-safety
    lint). See the package README for why."""

    def __init__(self, passes: Sequence[GraphPass]) -> None:
        self.passes: list[GraphPass] = list(passes)
        self.tail: list[GraphPass] = [
            GraphPass(_builtin_pass(name), name, builtin=True)
            for name in ("lower_auto_functionalized", "dead_code_elimination", "capture_safety_lint")
        ]

    @classmethod
    def from_config(cls, config: Any) -> PassManager:
        """Builds the pass list from a config read with getattr (built-in options default to True,
        user passes to None). Option values are fixed here: they are part of the identity."""
        passes: list[GraphPass] = []
        pre = _check_user_pass("post_grad_custom_pre_pass", getattr(config, "post_grad_custom_pre_pass", None))
        if pre is not None:
            passes.append(GraphPass(pre, "post_grad_custom_pre_pass"))
        for option in BUILTIN_OPTIONS:
            if _check_bool(option, getattr(config, option, True)):
                reads: dict[str, object] = {option: True}
                if option == "pattern_fusion_pass":
                    reads["registered_replacements"] = _user_rule_digests()
                passes.append(GraphPass(_builtin_pass(option), option, reads, builtin=True))
        post = _check_user_pass("post_grad_custom_post_pass", getattr(config, "post_grad_custom_post_pass", None))
        if post is not None:
            passes.append(GraphPass(post, "post_grad_custom_post_pass"))
        return cls(passes)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes + self.tail]

    def identity(self) -> str:
        """sha256 over the identities of every pass that runs, in order (for cache keys)."""
        return combine(*(p.identity() for p in self.passes + self.tail))

    def run(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        config: Any,
        observer: Observer | None = None,
    ) -> list[PassRecord]:
        """Runs every pass on ``gm`` in place and returns one record per pass.

        The graph is recompiled after a pass that changed it when an observer is given (so it
        can print the code), and once at the end otherwise.
        """
        self._set_up()
        records: list[PassRecord] = []
        any_changed = False
        for graph_pass in self.passes + self.tail:
            before = _fingerprint(gm.graph)
            nodes_before = _count(gm.graph)
            start = time.perf_counter()
            try:
                graph_pass(gm, example_inputs, config)
            except PassError:
                raise
            except Exception as exc:
                if graph_pass.name in BUILTIN_OPTIONS:
                    hint = f"set the option {graph_pass.name}=False to skip it, and report the bug"
                elif graph_pass.name in USER_PASS_OPTIONS:
                    hint = f"fix the callable given as {graph_pass.name}"
                else:
                    hint = "this is a bug in npugraph-passes; please report it"
                raise PassError(
                    graph_pass.name,
                    f"graph pass {graph_pass.name!r} raised {type(exc).__name__}: {exc} ({hint})",
                ) from exc
            seconds = time.perf_counter() - start
            changed = _fingerprint(gm.graph) != before
            record = PassRecord(graph_pass.name, seconds, changed, nodes_before, _count(gm.graph))
            records.append(record)
            if changed:
                any_changed = True
                if observer is not None:
                    gm.recompile()
            if observer is not None:
                observer(graph_pass.name, gm, record)
        if any_changed and observer is None:
            gm.recompile()
        return records

    def _set_up(self) -> None:
        start = time.perf_counter()
        done = [p.name for p in self.passes + self.tail
                if isinstance(p.fn, _BuiltinPass) and p.fn.set_up()]
        if done:
            log.debug("passes' one-time setup (imports, rule registration) for %s: %.3f ms",
                      ", ".join(done), (time.perf_counter() - start) * 1e3)

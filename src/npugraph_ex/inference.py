"""``npugraph_ex.inference``: the compile cache wired to the npugraph_ex backend.

``cache_compile(model.decode, options={...})`` compiles the method once with the npugraph_ex
backend (dynamo fullgraph, AOT, passes, capture manager), saves it with its guards under
``<cache_dir>/<model_info>/[world<W>global_rank<R>/]<func>/`` and, in later processes, loads it
without running dynamo, AOT or the passes. Device graphs are never stored: they are captured
again on the first calls of each process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from npugraph_backend import CompiledGraph, CompilerConfig, npugraph_ex_backend
from npugraph_backend.serialization import observe_compiled, pass_identity, versions
from npugraph_cache import CacheArgumentError, CacheCompiledFunction, EntryData
from npugraph_cache import cache_compile as _cache_compile
from npugraph_runtime.devices.cpu_kernels import DecisionJournal, seed_kernel_decisions

if TYPE_CHECKING:
    from npugraph_cache import readable_cache

__all__ = ["cache_compile", "readable_cache"]


class _Backend:
    """The dynamo backend for one cache_compile: our backend with fixed options, recording the
    optimized graphs' code for readable_cache."""

    def __init__(
        self, config: CompilerConfig, decompositions: Mapping[Any, Any] | None,
        journal: DecisionJournal,
    ) -> None:
        self.config = config
        self.decompositions = dict(decompositions) if decompositions else None
        self.codes: list[str] = []
        self.journal = journal

    def _record(self, compiled: CompiledGraph) -> None:
        self.codes.append(f"# {compiled.name} on {compiled.device}\n{compiled.gm.code.strip()}")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.journal.start()  # the entry's first call captures next, in this thread
        with observe_compiled(self._record):
            return npugraph_ex_backend(
                gm, example_inputs, options=self.config.copy(), decompositions=self.decompositions
            )

    def readable_code(self) -> str:
        return "\n\n".join(self.codes)


def _seed_authenticated(data: Any) -> int:
    """The cache seeds only entries whose HMAC verified with this user's key: trusted."""
    return seed_kernel_decisions(data, trusted=True)


def _config(options: Mapping[str, Any] | CompilerConfig | None) -> CompilerConfig:
    config = CompilerConfig.from_options(options)  # OptionError (a ValueError) names the option
    if config.use_graph_pool is not None:
        raise CacheArgumentError(
            "cache_compile: option use_graph_pool is a live pool of this process and cannot be "
            "cached; leave it unset (each graph gets its own pool) or use torch.compile"
        )
    return config


def cache_compile(
    func: Callable[..., Any],
    *,
    dynamic: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    global_rank: int | None = None,
    tp_rank: int | None = None,
    pp_rank: int | None = None,
    **kwargs: Any,
) -> CacheCompiledFunction:
    """Compile ``func`` (a bound method of an ``nn.Module``) with the npugraph_ex backend once
    and cache it on disk; later processes load it and skip dynamo, AOT and the passes.

    kwargs: ``options=`` (npugraph_ex options, as for torch.compile) and
    ``custom_decompositions=`` ({op: function}, applied by AOT); any other keyword is a
    ValueError. Every call runs torch's compiled function with its guards. The user guarantees
    what torch.compile(fullgraph=True) needs, plus: no random
    ops (refused), one phase per method (write prompt and decode as separate methods), the
    method not otherwise compiled or decorated. Calls run under ``torch.no_grad()``. See
    ``npugraph_cache.cache_compile`` for the layout, the key and the safety rules.
    """
    options = kwargs.get("options")
    config = _config(options)
    key_extra = {
        "compiler": "npugraph_ex",
        "config": config.hash(),
        "passes": pass_identity(config),
        "versions": versions(),
        "parameter_guards": False,
    }

    # The CPU recorder's kernel choices go into the entry after its first call (only that
    # call's: the journal), and a warm start in the same environment re-uses them unverified.
    journal = DecisionJournal()

    def compile_fn(
        _options: Mapping[str, Any] | None, decompositions: Mapping[Any, Any] | None
    ) -> _Backend:
        return _Backend(config, decompositions, journal)

    if isinstance(options, CompilerConfig):
        kwargs = {**kwargs, "options": config.as_dict()}
    return _cache_compile(
        func,
        dynamic=dynamic,
        cache_dir=cache_dir,
        global_rank=global_rank,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        compile_fn=compile_fn,
        key_extra=key_extra,
        entry_data=EntryData(export=journal.export, seed=_seed_authenticated),
        # the capture manager checks every parameter's address on each call (a re-bound one is
        # a new capture): torch's per-call TENSOR_MATCH on 100 parameters would cost ~12 µs
        parameter_guards=False,
        **kwargs,
    )


def __getattr__(name: str) -> Any:
    # readable_cache on first use: a warm start does not need it
    if name == "readable_cache":
        from npugraph_cache import readable_cache

        globals()[name] = readable_cache
        return readable_cache
    raise AttributeError(f"module 'npugraph_ex.inference' has no attribute {name!r}")

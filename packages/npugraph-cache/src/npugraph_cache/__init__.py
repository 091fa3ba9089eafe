"""npugraph-cache: on-disk compile artifacts (format, keys, store) and cache_compile.

Depends on torch only; the compiler (backend, options hash, pass identities) is injected by the
caller through ``compile_fn`` and ``key_extra``. The names whose modules import torch are
imported on first use (``_LAZY``).
"""

import importlib
from typing import TYPE_CHECKING, Any

from npugraph_cache.__about__ import __version__
from npugraph_cache.errors import (
    CacheArgumentError,
    CacheEntryError,
    CacheError,
    CachePermissionError,
    CacheTypeError,
    CacheWarning,
    FormatError,
)
from npugraph_cache.format import FORMAT_VERSION
from npugraph_cache.secret import KEY_ENV, key_path
from npugraph_cache.store import DEFAULT_CACHE_DIR, CacheStore

if TYPE_CHECKING:
    from npugraph_cache.compile_cache import (
        CacheCompiledFunction,
        CompileFn,
        EntryData,
        cache_compile,
        eager_compile_fn,
    )
    from npugraph_cache.keys import CacheKey, build_key, model_info, rank_component
    from npugraph_cache.readable import readable_cache
    from npugraph_cache.rng import RngGraphError

# Names whose modules import torch, imported on first use: `import npugraph_cache` (and so
# `npugraph-ex cache --help`, `cache ls`, `cache clear`) stays torch-free, and a warm start does
# not pay for readable_cache.
_LAZY: dict[str, str] = {
    "CacheCompiledFunction": "npugraph_cache.compile_cache",
    "CompileFn": "npugraph_cache.compile_cache",
    "EntryData": "npugraph_cache.compile_cache",
    "cache_compile": "npugraph_cache.compile_cache",
    "eager_compile_fn": "npugraph_cache.compile_cache",
    "CacheKey": "npugraph_cache.keys",
    "build_key": "npugraph_cache.keys",
    "model_info": "npugraph_cache.keys",
    "rank_component": "npugraph_cache.keys",
    "readable_cache": "npugraph_cache.readable",
    "RngGraphError": "npugraph_cache.rng",
}

__all__ = [
    "DEFAULT_CACHE_DIR",
    "FORMAT_VERSION",
    "KEY_ENV",
    "CacheArgumentError",
    "CacheCompiledFunction",
    "CacheEntryError",
    "CacheError",
    "CacheKey",
    "CachePermissionError",
    "CacheStore",
    "CacheTypeError",
    "CacheWarning",
    "CompileFn",
    "EntryData",
    "FormatError",
    "RngGraphError",
    "__version__",
    "build_key",
    "cache_compile",
    "eager_compile_fn",
    "key_path",
    "model_info",
    "rank_component",
    "readable_cache",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'npugraph_cache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

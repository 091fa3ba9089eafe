"""npugraph-cache: on-disk compile artifacts (format, keys, store) and cache_compile.

Depends on torch only; the compiler (backend, options hash, pass identities) is injected by the
caller through ``compile_fn`` and ``key_extra``. ``readable_cache`` is imported on first use (a
warm start does not need it).
"""

from typing import TYPE_CHECKING, Any

from npugraph_cache.__about__ import __version__
from npugraph_cache.compile_cache import (
    CacheCompiledFunction,
    CacheWarning,
    CompileFn,
    EntryData,
    cache_compile,
    eager_compile_fn,
)
from npugraph_cache.errors import (
    CacheArgumentError,
    CacheEntryError,
    CacheError,
    CachePermissionError,
    CacheTypeError,
    FormatError,
)
from npugraph_cache.format import FORMAT_VERSION
from npugraph_cache.keys import CacheKey, build_key, model_info, rank_component
from npugraph_cache.rng import RngGraphError
from npugraph_cache.secret import KEY_ENV, key_path
from npugraph_cache.store import DEFAULT_CACHE_DIR, CacheStore

if TYPE_CHECKING:
    from npugraph_cache.readable import readable_cache

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
    if name == "readable_cache":
        from npugraph_cache.readable import readable_cache

        globals()[name] = readable_cache
        return readable_cache
    raise AttributeError(f"module 'npugraph_cache' has no attribute {name!r}")

"""npugraph-backend: the ``npugraph_ex`` torch.compile backend, its options and compile_fx."""

from npugraph_backend.__about__ import __version__
from npugraph_backend.backend import ModeIgnoredWarning, npugraph_ex_backend
from npugraph_backend.compiler import (
    CompiledGraph,
    EagerFallbackWarning,
    ForwardCompiler,
    NpuOnlyOptionWarning,
    compile_fx,
)
from npugraph_backend.config import CompilerConfig, OptionError, PassOptionError

__all__ = [
    "CompiledGraph",
    "CompilerConfig",
    "EagerFallbackWarning",
    "ForwardCompiler",
    "ModeIgnoredWarning",
    "NpuOnlyOptionWarning",
    "OptionError",
    "PassOptionError",
    "__version__",
    "compile_fx",
    "npugraph_ex_backend",
]

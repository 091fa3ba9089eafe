"""transformers' ``generate``, compiled by npugraph_ex on every device (CPU, CUDA, NPU).

One way, with transformers 4.5x and 5.x::

    from npugraph_ex.hf import compile_config

    out = model.generate(input_ids, max_new_tokens=32, do_sample=False,
                         cache_implementation="static", compile_config=compile_config())

``generate`` runs the prompt eagerly and every decode step through the compiled forward: one
capture, replayed for every later token. A plain ``CompileConfig(backend="npugraph_ex")`` is
compiled on CUDA only: on the CPU or an NPU transformers skips compilation, logging "unable to
meet the criteria for compilation", and nothing is captured. ``compile_config`` sets what makes
it compile everywhere, validates the options now (``OptionError`` here, not at the first decode
step), and leaves out torch.compile's ``mode`` (which torch refuses alongside ``options``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from npugraph_ex import _compat

__all__ = ["compile_config"]


def _backend() -> Any:
    import torch

    if "npugraph_ex" in torch.compiler.list_backends():
        return "npugraph_ex"
    # A source tree on PYTHONPATH without the installed entry point: the backend callable.
    from npugraph_backend import npugraph_ex_backend

    return npugraph_ex_backend


def compile_config(
    options: Mapping[str, object] | None = None, *, fullgraph: bool = True, dynamic: bool = False
) -> Any:
    """A ``transformers.CompileConfig`` for ``generate(..., cache_implementation="static",
    compile_config=...)`` that compiles with backend="npugraph_ex" on every device.

    options: npugraph_ex options (the README's table), validated now: an ``OptionError`` (a
    ``ValueError``) names a bad one. fullgraph and dynamic are passed to torch.compile; the
    defaults (one graph, static shapes) are what a static cache decode step needs."""
    from transformers import CompileConfig

    from npugraph_ex import validate_options

    validate_options(options)
    config = CompileConfig(
        fullgraph=fullgraph,
        dynamic=dynamic,
        backend=_backend(),
        mode=None,  # type: ignore[arg-type]  # torch.compile refuses mode= with options=
        options=dict(options) if options else None,
    )
    _compat.compile_on_every_device(config)
    return config

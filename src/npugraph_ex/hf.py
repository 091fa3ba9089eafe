"""transformers' ``generate``, compiled by npugraph_ex on every device (CPU, CUDA, NPU).

Every generation mode (greedy, sampling, beam search, ...), with transformers 4.5x and 5.x::

    import npugraph_ex.hf

    out = npugraph_ex.hf.generate(model, input_ids, max_new_tokens=32, num_beams=3,
                                  cache_implementation="static")

runs the prompt eagerly and every one-token step through the model's forward compiled with
backend="npugraph_ex": one capture, replayed for every later token.

transformers' own route, ``model.generate(..., compile_config=compile_config())``, compiles the
step only in the modes whose loop asks for it (4.57: greedy and sampling, ``_sample``, and
assisted decoding); beam search and the others call the plain forward and the config is unused.
A plain ``CompileConfig(backend="npugraph_ex")`` is
compiled on CUDA only: on the CPU or an NPU transformers skips compilation, logging "unable to
meet the criteria for compilation", and nothing is captured. ``compile_config`` sets what makes
it compile everywhere, validates the options now (``OptionError`` here, not at the first decode
step), and leaves out torch.compile's ``mode`` (which torch refuses alongside ``options``)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

from npugraph_ex import _compat

__all__ = ["compile_config", "generate"]

# The model attribute that keeps generate()'s compiled forward between calls, with its options.
_COMPILED = "_npugraph_ex_compiled_forward"


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


def generate(model: Any, *args: Any, options: Mapping[str, object] | None = None,
             **kwargs: Any) -> Any:
    """``model.generate(*args, **kwargs)`` with every one-token step run by the model's forward
    compiled with backend="npugraph_ex", in every generation mode.

    transformers decides per mode whether its loop calls a compiled step (4.57: only
    ``_sample`` and ``_assisted_decoding`` do); here the forward itself is compiled, so beam
    search and the others replay a capture too. A call whose input holds one token per row
    (a decode step) goes to the compiled forward; the prompt and longer calls (assisted
    decoding's candidates) run eagerly, as transformers' own compiled loop does, so a new
    prompt length is not a new capture. The compiled forward is kept on the model for the next
    call with the same options. Pass ``cache_implementation="static"``: a dynamic cache grows
    every step, and every step would be a new graph (a ``RuntimeWarning`` says so).

    options: npugraph_ex options, validated now (an ``OptionError`` names a bad one). Not
    thread-safe for concurrent ``generate`` calls on one model: the model's ``forward`` is
    replaced for the duration of the call."""
    for name in ("compile_config", "disable_compile"):
        if name in kwargs:
            raise ValueError(
                f"npugraph_ex.hf.generate: argument {name!r} (value {kwargs[name]!r}) is not "
                "allowed: generate compiles the forward itself; pass npugraph_ex options as "
                "options=..., or call model.generate for transformers' own compilation"
            )
    compiled = _compiled_forward(model, options)
    cache = kwargs.get("cache_implementation", getattr(model.generation_config,
                                                       "cache_implementation", None))
    if "past_key_values" not in kwargs and cache in (None, "dynamic"):
        warnings.warn(
            f"npugraph_ex.hf.generate: cache_implementation={cache!r}: a dynamic cache grows "
            "every step, so every decode step is a new graph (compiled again, never replayed); "
            "pass cache_implementation='static'",
            RuntimeWarning,
            stacklevel=2,
        )
    had_own = "forward" in vars(model)
    eager = model.forward

    def forward(*f_args: Any, **f_kwargs: Any) -> Any:
        step = f_kwargs.get("input_ids")
        if step is None:
            step = f_kwargs.get("inputs_embeds")
        if not f_args and step is not None and step.dim() >= 2 and step.shape[1] == 1:
            return compiled(**f_kwargs)
        return eager(*f_args, **f_kwargs)

    model.forward = forward
    try:
        # disable_compile: transformers' loop must call the forward above, not compile it again
        return model.generate(*args, disable_compile=True, **kwargs)
    finally:
        if had_own:
            model.forward = eager
        else:
            del model.forward


def _compiled_forward(model: Any, options: Mapping[str, object] | None) -> Callable[..., Any]:
    import torch

    from npugraph_ex import validate_options

    validate_options(options)
    wanted = dict(options) if options else None
    kept = vars(model).get(_COMPILED)
    if kept is not None and kept[0] == wanted:
        return kept[1]  # type: ignore[no-any-return]
    compiled = torch.compile(model.forward, backend=_backend(), fullgraph=True, dynamic=False,
                             options=wanted)  # type: ignore[arg-type]  # validated above
    # object.__setattr__: a function is no submodule or parameter, and nn.Module's own
    # __setattr__ would only add its bookkeeping
    object.__setattr__(model, _COMPILED, (wanted, compiled))
    return compiled

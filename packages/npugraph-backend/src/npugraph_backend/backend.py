"""The torch.compile backend ``npugraph_ex`` (registered through the torch_dynamo_backends entry point).

Inference only: a Dynamo graph that would need gradients (grad mode on and an input that
requires grad) runs eagerly, with one warning, instead of being half-captured. Use
``torch.no_grad()`` or ``torch.inference_mode()`` around the compiled call to capture it."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from npugraph_runtime.callsite import warn_at_caller
from npugraph_runtime.counters import REQUIRES_GRAD, fallback_counter
from npugraph_runtime.devices import inputs_device

from npugraph_backend import _compat
from npugraph_backend.compiler import (
    EagerCompiler,
    EagerFallbackWarning,
    ForwardCompiler,
    begin_debug,
    warn_npu_only_options,
)
from npugraph_backend.config import CompilerConfig, OptionError
from npugraph_backend.logs import log
from npugraph_backend.padding_plan import argument_names
from npugraph_backend.torch_streams import (
    EXTERNAL_WAITS,
    rewrite_torch_streams,
    with_external_waits,
)


class ModeIgnoredWarning(UserWarning):
    """torch.compile's ``mode=`` means nothing to npugraph_ex (transformers passes one)."""


def _inputs_needing_grad(example_inputs: Sequence[object]) -> list[int]:
    return [
        i for i, x in enumerate(example_inputs)
        if isinstance(x, torch.Tensor) and x.requires_grad
    ]


def npugraph_ex_backend(
    gm: torch.fx.GraphModule, example_inputs: Sequence[object], **kwargs: Any
) -> Callable[..., Any]:
    """What Dynamo calls per graph: ``torch.compile(model, backend="npugraph_ex", options=...)``.

    Accepts ``options=`` (a dict of API.md options, or a CompilerConfig) and ``mode=`` (ignored,
    with one warning). Any other keyword is refused."""
    options = kwargs.pop("options", None)
    mode = kwargs.pop("mode", None)
    # {op: decomposition} applied by AOT (npugraph_ex.inference.cache_compile's
    # custom_decompositions)
    decompositions = kwargs.pop("decompositions", None)
    if kwargs:
        name = next(iter(kwargs))
        raise OptionError(
            f"npugraph_ex backend: unknown keyword {name!r}={kwargs[name]!r}; allowed keywords: "
            "options (a dict of npugraph_ex options), decompositions and mode (ignored)"
        )
    config = CompilerConfig.from_options(options)  # fresh per graph: nothing leaks
    if mode is not None:
        warnings.warn(
            f"npugraph_ex ignores torch.compile mode={mode!r}: it always captures the whole "
            "graph; configure it with options= instead",
            ModeIgnoredWarning,
            stacklevel=2,
        )
    warn_npu_only_options(config, inputs_device(example_inputs))

    # torch.Stream / torch.Event: into our scope ops, so one lowering serves every stream API
    rewrite_torch_streams(gm)
    needs_grad = _inputs_needing_grad(example_inputs)
    if torch.is_grad_enabled() and needs_grad:
        warn_at_caller(
            f"npugraph_ex captures inference graphs only: this graph runs eagerly because grad "
            f"mode is on and inputs {needs_grad} require grad (parameters usually do). Call the "
            "compiled model under torch.no_grad() or torch.inference_mode() to capture it.",
            EagerFallbackWarning,
        )
        _compat.counters()[fallback_counter(REQUIRES_GRAD)] += 1
        log.info("dynamo graph runs eagerly: grad mode on, inputs %s require grad", needs_grad)
        return with_external_waits(gm.forward, gm.meta.get(EXTERNAL_WAITS, []))

    training = EagerCompiler("needs gradients")
    # Serializable output when torch asks for it (bundled AOTAutograd cache, aot_compile): see
    # serialization.py. Imported here: it is only needed once a graph is compiled.
    from npugraph_backend.serialization import serializable_compilers

    fw_compiler, inference_compiler, cache_tag = serializable_compilers(
        config, training, ForwardCompiler(config, begin_debug(gm), argument_names(gm, config))
    )
    with cache_tag:
        compiled = _compat.aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=fw_compiler,  # only reached if AOT builds a training graph after all
            bw_compiler=training,
            inference_compiler=inference_compiler,
            decompositions=decompositions,
            keep_inference_input_mutations=True,
        )
    return with_external_waits(compiled, gm.meta.get(EXTERNAL_WAITS, []))

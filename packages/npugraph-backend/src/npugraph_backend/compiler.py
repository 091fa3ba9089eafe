"""The forward compiler: AOT inference graph -> passes -> specs -> runtime GraphedCallable.

``ForwardCompiler`` is a module-level, picklable object (its state is the options), so the cache
can serialize the backend. ``CompiledGraph`` is what it returns: a boxed callable holding the
optimized graph, its specs and the options as a plain dict; the device graphs are rebuilt when it
is unpickled."""

from __future__ import annotations

import logging
import os
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import npugraph_runtime
import torch
import torch.fx
from npugraph_runtime import CapturePolicy, InputSpec, OutputSpec
from npugraph_runtime.callsite import warn_at_caller
from npugraph_runtime.counters import REQUIRES_GRAD, UNSAFE_OP, default_name, fallback_counter
from npugraph_runtime.devices import inputs_device
from npugraph_runtime.graphs import as_pool_handle

from npugraph_backend import _compat, process_groups
from npugraph_backend.config import NPU_ONLY_OPTIONS, CompilerConfig, rebuild_config
from npugraph_backend.dfx import ranges
from npugraph_backend.logs import log
from npugraph_backend.padding import PaddedCall
from npugraph_backend.padding_plan import ArgumentNames, PaddingPlan


class EagerFallbackWarning(UserWarning):
    """A graph runs eagerly instead of being captured (the message says why)."""


class NpuOnlyOptionWarning(UserWarning):
    """An NPU-only option was set for a graph on another device, where it does nothing."""


UNSAFE_NODES_META = "npugraph_ex_unsafe_nodes"


def next_graph_name() -> str:
    # the runtime's counter (atomic under the GIL): its unnamed callables share the names' space
    return default_name()


def warn_npu_only_options(config: CompilerConfig, device: torch.device) -> None:
    """static_kernel_compile & co. mean something only on an Ascend NPU: one warning elsewhere."""
    if device.type == "npu":
        return
    on = [name for name in NPU_ONLY_OPTIONS if getattr(config, name)]
    if on:
        warnings.warn(
            f"options {', '.join(on)} are NPU features (static kernel compilation); on "
            f"{device.type} they do nothing",
            NpuOnlyOptionWarning,
            stacklevel=3,
        )


def begin_debug(dynamo_gm: torch.fx.GraphModule | None) -> Any:
    """The TORCH_COMPILE_DEBUG session of one graph, or None when debugging is off."""
    # The dfx modules and the passes are imported by the compile (and a dump) only: a graph
    # loaded from the compile cache needs neither.
    from npugraph_backend.dfx import debug as debug_dumps

    return debug_dumps.DebugSession.begin(dynamo_gm)


@ranges.ranged(ranges.PASSES)
def run_passes(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[object],
    config: CompilerConfig,
    observer: Callable[[str, torch.fx.GraphModule, Any], None] | None = None,
) -> None:
    """Custom pre pass, built-ins, custom post pass, then the capture-safety lint."""
    from npugraph_passes import PassManager

    pm = PassManager.from_config(config)
    records = pm.run(gm, example_inputs, config, observer=observer)
    if log.isEnabledFor(logging.DEBUG):
        for r in records:
            log.debug("pass %s: %.3f ms, changed=%s, %d -> %d nodes", r.name, r.seconds * 1e3,
                      r.changed, r.nodes_before, r.nodes_after)


def _dump_original(config: CompilerConfig) -> bool:
    return config.dump_tensor_data and config.data_dump_stage == "original"


def _enters_scopes(gm: Any) -> bool:
    """The graph calls ``npugraph_ex.scope_enter``. A loaded graph (saved_forward.LoadedGraph) is
    asked through its code object, so that its FX graph is not unpickled for it."""
    if isinstance(gm, torch.fx.GraphModule):
        return any(node.target is _SCOPE_ENTER for node in gm.graph.nodes)
    code = getattr(gm.forward, "__code__", None)
    return code is None or "scope_enter" in code.co_names


_SCOPE_ENTER = torch.ops.npugraph_ex.scope_enter.default


class CompiledGraph:
    """A compiled AOT forward: boxed callable (``compiled(list_of_args)``) as AOT expects.

    State (``__getstate__``) is a plain dict: the optimized GraphModule, the input and output
    specs, the options, the graph name, the device, and why it runs eagerly (or None). The
    runtime's GraphedCallable (``.runner``) and its device graphs are rebuilt from it."""

    _boxed_call = True

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        inputs: InputSpec,
        outputs: OutputSpec,
        config: CompilerConfig,
        name: str,
        device: torch.device,
        eager_reason: str | None = None,
        debug: Any = None,
        value_ints: tuple[int, ...] = (),
        padding: PaddingPlan | None = None,
    ) -> None:
        self.gm = gm
        self.value_ints = value_ints  # int inputs the graph takes as 0-d tensors (scalar_inputs)
        self.padding = padding
        self.inputs = inputs
        self.outputs = outputs
        self.config = config
        self.name = name
        self.device = device
        self.eager_reason = eager_reason
        self.runner: Any = None
        self._fn: Callable[..., Any] = gm.forward
        self._build(debug)

    def policy(self) -> CapturePolicy:
        config = self.config
        pool: object
        if config.use_graph_pool is not None:
            pool = as_pool_handle(config.use_graph_pool, self.device)
        else:
            pool = "shared" if config.reuse_graph_pool_in_same_fx else "private"
        return CapturePolicy(
            capture_limit=config.capture_limit,
            force_recapture=config.force_recapture,
            force_eager=config.force_eager,
            clone_input=config.clone_input,
            # with capture_sizes, a server keeps each step's logits past the next call: the
            # outputs are copies, so that a kept step costs a copy, not a second capture per size
            # (the held-output capture)
            clone_output=config.clone_output or config.capture_sizes is not None,
            pool=pool,
            check_static_addresses=not config.frozen_parameter,
            capture_error_mode=config.capture_error_mode,
            name=self.name,
        )

    def _build(self, debug: Any = None) -> None:
        if _dump_original(self.config):
            # The un-optimised graph, run eagerly by the dumper: nothing is captured.
            from npugraph_backend.dfx import data_dump

            self.runner = None
            self._fn = data_dump.original_runner(self.gm, self.config)
            return
        forward = self.gm.forward
        if _enters_scopes(self.gm):
            forward = npugraph_runtime.ops.restoring_scopes(forward)
        if self.eager_reason is not None:
            self.runner = None
            fn: Callable[..., Any] = forward
        else:
            policy = self.policy()
            self.runner = npugraph_runtime.GraphedCallable(
                forward, self.inputs, policy, device=self.device, output_spec=self.outputs,
                functional=True,
            )
            fn = self.runner
            if self.padding is not None:
                fn = PaddedCall(self.runner, self.padding)
            if debug is not None:
                from npugraph_backend.dfx import debug as debug_dumps

                summary = debug_dumps.spec_summary(self.gm, self.inputs, policy, self.outputs)
                debug.output_code(self.gm, summary)
                fn = debug.watch(fn, summary)  # the padded call too: it reads the runner's events
        if self.config.dump_tensor_data:
            from npugraph_backend.dfx import data_dump

            fn = data_dump.after_each_call(fn, self.gm)
        self._fn = process_groups.guard(fn, self.gm, self.name)
        if self.value_ints:
            from npugraph_backend.scalar_inputs import passing_ints_as_tensors

            self._fn = passing_ints_as_tensors(self._fn, self.value_ints, self.device)

    def __call__(self, args: list[Any]) -> Any:
        return self._fn(*args)

    def positional_call(self) -> Callable[..., Any]:
        """``__call__`` with the inputs as positional arguments."""
        return self._fn

    def __getstate__(self) -> dict[str, Any]:
        return {
            "gm": self.gm,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "config": self.config.as_dict(),
            "name": self.name,
            "device": str(self.device),
            "eager_reason": self.eager_reason,
            "value_ints": self.value_ints,
            "padding": self.padding,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.gm = state["gm"]
        self.inputs = state["inputs"]
        self.outputs = state["outputs"]
        self.config = rebuild_config(state["config"])
        self.name = state["name"]
        self.device = torch.device(state["device"])
        self.eager_reason = state["eager_reason"]
        self.value_ints = tuple(state.get("value_ints", ()))
        self.padding = state.get("padding")
        # TORCH_COMPILE_DEBUG=1 on a warm start: this graph's dumps (read here first: a warm
        # start imports no dfx module otherwise)
        debug = begin_debug(None) if os.environ.get("TORCH_COMPILE_DEBUG") == "1" else None
        if debug is not None:
            debug.loaded(self.name)
        self._build(debug)

    def __repr__(self) -> str:
        how = f"eager ({self.eager_reason})" if self.eager_reason else "captured"
        return f"CompiledGraph({self.name}, {self.device}, {how})"


@ranges.ranged(ranges.COMPILE)
def compile_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[object],
    config: CompilerConfig,
    debug: Any = None,
    names: ArgumentNames | None = None,
) -> CompiledGraph:
    """Passes, specs, then the runtime's GraphedCallable. ``config`` is not modified.
    ``debug``: the TORCH_COMPILE_DEBUG session of this graph (None: begin one if enabled).
    ``names``: the forward's argument names of the Dynamo graph's inputs (for pad_values)."""
    from npugraph_passes.stream_scopes import lower_stream_scopes

    from npugraph_backend.dfx import data_dump, deadlock
    from npugraph_backend.padding_analysis import plan_for
    from npugraph_backend.scalar_inputs import as_value_inputs, lift_value_ints
    from npugraph_backend.specs import build_specs

    config = config.copy()
    name = next_graph_name()
    device = inputs_device(example_inputs)
    if debug is None:
        debug = begin_debug(None)
    if debug is not None:
        debug.forward_graph(gm)
    # Specs first: the AOT descriptors and mutations describe the graph as AOT produced it.
    specs = build_specs(gm, example_inputs)
    log.debug("%s: input kinds %s (mapped by %s), output aliasing %s", name,
              [k.value for k in specs.inputs.kinds], specs.how, specs.outputs.aliases_input)
    if _dump_original(config):
        return CompiledGraph(gm, specs.inputs, specs.outputs, config, name, device,
                             "data_dump_stage='original' runs the original graph eagerly", debug)
    # on the graph as AOT made it: functional ops, the user's source lines
    padding = plan_for(gm, specs, config, names)
    # after the plan: an int lifted to a 0-d tensor sizes no tensor, so padding never touches it
    value_ints = lift_value_ints(gm, device, name)
    inputs = as_value_inputs(specs.inputs, value_ints) if value_ints else specs.inputs
    # streams and core limits of the graph first: the passes must see its events
    if lower_stream_scopes(gm, device, name):
        # the graph's events live as long as the graph module does
        weakref.finalize(gm, npugraph_runtime.ops.forget_graph_events, f"{name}_")
    run_passes(gm, example_inputs, config, debug.pass_observer if debug is not None else None)
    if config.deadlock_check:
        folder = debug.model_dir if debug is not None else data_dump.dump_root(config)
        deadlock.run(gm, name, device, folder)
    if config.dump_tensor_data:
        data_dump.instrument(gm, config)
    gm.recompile()
    eager_reason = None
    unsafe = gm.meta.get(UNSAFE_NODES_META) or []
    if unsafe and not config.force_eager:
        described = "; ".join(str(u) for u in unsafe)
        eager_reason = f"cannot be captured: {described}"
        warn_at_caller(
            f"npugraph_ex: {name} runs eagerly (never captured) because it {eager_reason}",
            EagerFallbackWarning,
        )
        _compat.counters()[fallback_counter(UNSAFE_OP, name)] += 1
        log.info("%s falls back to eager: %s", name, eager_reason)
    return CompiledGraph(gm, inputs, specs.outputs, config, name, device, eager_reason, debug,
                         value_ints, padding)


class ForwardCompiler:
    """AOT's inference compiler for one Dynamo graph. Picklable: its state is the options (the
    debug session of the graph being compiled is not part of it)."""

    def __init__(
        self, config: CompilerConfig, debug: Any = None, names: ArgumentNames | None = None
    ) -> None:
        self.config = config
        self.debug = debug
        self.names = names

    def __call__(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[object]
    ) -> CompiledGraph:
        return compile_graph(gm, example_inputs, self.config, self.debug, self.names)

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config.as_dict(), "names": self.names}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.config = rebuild_config(state["config"])
        self.debug = None
        self.names = state.get("names")


class EagerCompiler:
    """AOT's forward/backward compiler for a graph that needs gradients: run it eagerly."""

    def __init__(self, why: str) -> None:
        self.why = why

    def __call__(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[object]
    ) -> Callable[[list[Any]], Any]:
        warn_at_caller(
            f"npugraph_ex captures inference graphs only: a graph that {self.why} runs eagerly; "
            "call the compiled model under torch.no_grad() or torch.inference_mode()",
            EagerFallbackWarning,
        )
        _compat.counters()[fallback_counter(REQUIRES_GRAD)] += 1
        return _compat.make_boxed(gm.forward)


def compile_fx(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[object] | None = None,
    options: dict[str, object] | CompilerConfig | None = None,
) -> CompiledGraph:
    """Compile an AOT inference graph (after ``aot_module_simplified``) for custom backends.

    ``example_inputs`` default to the placeholders' recorded values. For the input_inplace_pass
    to update inputs in place, call ``aot_module_simplified`` with
    ``keep_inference_input_mutations=True``. The result takes its arguments boxed (one list),
    which is what AOT expects of a compiler's output."""
    config = CompilerConfig.from_options(options)
    if example_inputs is None:
        example_inputs = [n.meta.get("val") for n in _compat.placeholders(gm)]
    warn_npu_only_options(config, inputs_device(example_inputs))
    return compile_graph(gm, list(example_inputs), config)

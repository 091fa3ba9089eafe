"""Building the runtime's InputSpec and OutputSpec of an AOT inference graph.

Placeholders are mapped to AOT's flat inputs through their descriptors (``node.meta["desc"]``),
never by position. An input that cannot be mapped (a synthetic or view base, a token) is a USER
input — correct, only slower — unless the graph writes into it, which makes it MUTATED, since
copying it into a capture buffer would lose the write."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx
from npugraph_runtime import InputSpec, OutputSpec, SlotKind

from npugraph_backend import _compat


@dataclass(frozen=True)
class GraphSpecs:
    inputs: InputSpec
    outputs: OutputSpec
    how: str  # how placeholders were mapped: "descriptors", "metadata order", "example inputs"


def written_placeholders(gm: torch.fx.GraphModule) -> set[str]:
    """Names of placeholders some node writes into (copy_ epilogues, in-place and out= ops)."""
    written: set[str] = set()
    for node in gm.graph.nodes:
        schema = _compat.op_schema(node) if node.op == "call_function" else None
        if schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            values = value if isinstance(value, list | tuple) else [value]
            for v in values:
                if isinstance(v, torch.fx.Node) and v.op == "placeholder":
                    written.add(v.name)
    return written


def _symbolic_dims(value: object) -> tuple[int, ...]:
    if not isinstance(value, torch.Tensor):
        return ()
    return tuple(d for d, s in enumerate(value.shape) if _compat.symint_is_symbolic(s))


def build_specs(gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> GraphSpecs:
    """The input kinds, keyed dims and output aliasing of ``gm`` (an AOT forward graph)."""
    md = _compat.aot_metadata()
    nodes = _compat.placeholders(gm)
    written = written_placeholders(gm)
    origins = [_compat.input_origin(n) for n in nodes]
    has_desc = any(kind != "unknown" for kind, _ in origins)
    how = "descriptors" if has_desc else "example inputs"
    if not has_desc and md is not None and len(nodes) == md.num_tokens + len(md.mutates_data):
        # torch without descriptors: placeholders are tokens then the flat inputs, in order.
        origins = [("other", None)] * md.num_tokens + [
            ("plain", i) for i in range(len(md.mutates_data))
        ]
        how = "metadata order"

    kinds: list[SlotKind] = []
    keyed: list[tuple[int, ...] | None] = []
    flat_to_slot: dict[int, int] = {}
    for slot, (node, (origin, flat)) in enumerate(zip(nodes, origins, strict=True)):
        example = example_inputs[slot] if slot < len(example_inputs) else None
        value = _compat.example_value(node, example)
        if flat is not None:
            flat_to_slot.setdefault(flat, slot)
        if not isinstance(value, torch.Tensor):
            # ints (SymInt or specialised) select the graph key; so do other scalars, so a
            # changed value never replays a graph captured for another one.
            kinds.append(
                SlotKind.SYMBOLIC
                if isinstance(value, int | float | bool | torch.SymInt | torch.SymFloat | torch.SymBool)
                else SlotKind.CONSTANT
            )
            keyed.append(())
            continue
        mutated = node.name in written
        if origin in ("param", "buffer"):
            kind = SlotKind.STATIC
        elif origin == "plain" and md is not None and flat is not None:
            if flat in md.static_input_indices:
                kind = SlotKind.STATIC
            elif mutated or (flat < len(md.mutates_data) and md.mutates_data[flat]):
                kind = SlotKind.MUTATED
            else:
                kind = SlotKind.USER
        elif md is None and _compat.marked_static(example):
            kind = SlotKind.STATIC
        else:
            kind = SlotKind.MUTATED if mutated else SlotKind.USER
        if kind is SlotKind.STATIC and mutated:
            # A buffer updated in place (a cache registered on the module) keeps its address
            # like a parameter but must never be copied: the runtime treats it as mutated.
            kind = SlotKind.MUTATED
        kinds.append(kind)
        keyed.append(() if kind is SlotKind.STATIC else _symbolic_dims(value))

    outputs = _output_aliasing(gm, nodes, md, flat_to_slot)
    return GraphSpecs(InputSpec(tuple(kinds), tuple(keyed)), outputs, how)


def _output_aliasing(
    gm: torch.fx.GraphModule,
    nodes: Sequence[torch.fx.Node],
    md: _compat.AotMetadata | None,
    flat_to_slot: dict[int, int],
) -> OutputSpec:
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = out_node.args[0]
    outs = list(outs) if isinstance(outs, list | tuple) else [outs]
    slot_of = {n.name: i for i, n in enumerate(nodes)}
    origins = _compat.output_origins(gm)
    aliases: list[int | None] = []
    for j, out in enumerate(outs):
        alias: int | None = None
        if isinstance(out, torch.fx.Node) and out.op == "placeholder":
            alias = slot_of[out.name]
        elif md is not None:
            if origins is not None:
                kind, idx = origins[j] if j < len(origins) else ("other", None)
                user_out = idx if kind == "plain" else None
            else:
                # No descriptors: graph outputs are tokens, updated inputs, then user outputs.
                user_out = j - md.num_tokens - md.num_mutated_outputs
            if user_out is not None and 0 <= user_out < len(md.outputs):
                out_type, base = md.outputs[user_out]
                if out_type in ("alias_of_input", "is_input") and base is not None:
                    alias = flat_to_slot.get(base)
        if alias is None and isinstance(out, torch.fx.Node):
            alias = _structural_alias(out, nodes)
        aliases.append(alias)
    return OutputSpec(tuple(aliases))


def _structural_alias(out: torch.fx.Node, nodes: Sequence[torch.fx.Node]) -> int | None:
    value = out.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    for i, n in enumerate(nodes):
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            try:
                if _compat.is_alias_of(v, value):
                    return i
            except RuntimeError:
                return None
    return None

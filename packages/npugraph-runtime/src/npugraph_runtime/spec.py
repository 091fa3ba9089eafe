"""What the capture manager knows about each input slot and output of a callable.

The backend builds these from AOT metadata; `make_graphed_callable` infers them from example
inputs. The runtime never looks at FX graphs: the spec is the whole interface."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from npugraph_runtime.devices.base import check_capture_error_mode
from npugraph_runtime.errors import PolicyError


class SlotKind(enum.Enum):
    STATIC = "static"  # parameters, buffers, mark_static_address: never copied
    MUTATED = "mutated"  # updated in place by the graph (KV cache): never copied, new address -> recapture
    USER = "user"  # copied into the capture's buffer when its address differs
    SYMBOLIC = "symbolic"  # a number (int, float, bool) whose value selects the graph key
    CONSTANT = "constant"  # any other non-tensor argument: passed through, must not change


@dataclass(frozen=True)
class InputSpec:
    """Per positional input: its kind, and for tensors the dims whose sizes join the graph key.

    ``keyed_dims[i] is None`` means every dim of tensor slot ``i`` is keyed (the safe default for
    hand-written capture); ``()`` means its shape never changes (dynamo guards it)."""

    kinds: tuple[SlotKind, ...]
    keyed_dims: tuple[tuple[int, ...] | None, ...] = ()

    def __post_init__(self) -> None:
        if self.keyed_dims and len(self.keyed_dims) != len(self.kinds):
            raise PolicyError(
                f"InputSpec.keyed_dims has {len(self.keyed_dims)} entries for "
                f"{len(self.kinds)} inputs; give one per input or none"
            )

    @classmethod
    def infer(
        cls,
        example_inputs: Sequence[object],
        static_argnums: Sequence[int] = (),
        mutated_argnums: Sequence[int] = (),
    ) -> InputSpec:
        """Tensors are USER unless listed as static or mutated; ints, floats and bools are
        SYMBOLIC (their values key the graph: a replay can only repeat the value it captured);
        anything else is CONSTANT (checked on every call). Every dim of a user or mutated tensor
        is keyed."""
        n = len(example_inputs)
        for name, nums in (("static_argnums", static_argnums), ("mutated_argnums", mutated_argnums)):
            for i in nums:
                if not -n <= i < n or not isinstance(example_inputs[i], torch.Tensor):
                    raise PolicyError(
                        f"{name} contains {i}, which is not the index of a tensor input "
                        f"(there are {n} inputs)"
                    )
        static = {i % n for i in static_argnums}
        mutated = {i % n for i in mutated_argnums}
        if static & mutated:
            raise PolicyError(f"inputs {sorted(static & mutated)} are both static and mutated")
        kinds: list[SlotKind] = []
        for i, x in enumerate(example_inputs):
            if isinstance(x, torch.Tensor):
                kind = SlotKind.STATIC if i in static else SlotKind.MUTATED if i in mutated else SlotKind.USER
            elif isinstance(x, int | float):  # bool is an int
                kind = SlotKind.SYMBOLIC
            else:
                kind = SlotKind.CONSTANT
            kinds.append(kind)
        return cls(tuple(kinds), tuple(None for _ in kinds))

    def dims_keyed(self, i: int) -> tuple[int, ...] | None:
        return self.keyed_dims[i] if self.keyed_dims else None


@dataclass(frozen=True)
class OutputSpec:
    """Per output: the index of the input it aliases (returned as that input, never cloned), or None."""

    aliases_input: tuple[int | None, ...] = ()


PoolChoice = Literal["private", "shared"]


@dataclass(frozen=True)
class CapturePolicy:
    """How a GraphedCallable captures and replays. Decided once; the hot path reads nothing else."""

    warmup: int = 1
    capture_limit: int = 64
    force_recapture: bool = False
    force_eager: bool = False
    clone_input: bool = True
    clone_output: bool = False
    pool: object = "shared"  # "private", "shared", or a pool handle
    check_static_addresses: bool = True
    capture_error_mode: str = "global"
    name: str = field(default="")

    def __post_init__(self) -> None:
        if not isinstance(self.warmup, int) or isinstance(self.warmup, bool) or self.warmup < 0:
            raise PolicyError(f"warmup={self.warmup!r} is not allowed: give an int >= 0")
        if (
            not isinstance(self.capture_limit, int)
            or isinstance(self.capture_limit, bool)
            or self.capture_limit < 1
        ):
            raise PolicyError(
                f"capture_limit={self.capture_limit!r} is not allowed: give an int >= 1"
            )
        check_capture_error_mode(self.capture_error_mode)
        for flag in ("force_recapture", "force_eager", "clone_input", "clone_output",
                     "check_static_addresses"):
            if not isinstance(getattr(self, flag), bool):
                raise PolicyError(f"{flag}={getattr(self, flag)!r} is not allowed: give True or False")
        if isinstance(self.pool, str) and self.pool not in ("private", "shared"):
            raise PolicyError(
                f"pool={self.pool!r} is not allowed: use 'private', 'shared' or a pool handle "
                "from graph_pool_handle()"
            )

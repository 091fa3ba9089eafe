"""Every private torch API the passes touch, each with the torch versions it was checked on.
A torch upgrade is a change to this file only. Entries are appended; each guards its import so
that torch 2.11 keeps working with a fallback."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# torch._ops: the OpOverload types of dispatcher ops. Checked on 2.13.0 (stable since 2.0).
OpOverload: Any = torch._ops.OpOverload
OpOverloadPacket: Any = torch._ops.OpOverloadPacket
HigherOrderOperator: Any = torch._ops.HigherOrderOperator

# Symbolic-shape comparisons that never guard. Checked on 2.13.0 (present since 2.1).
def statically_known_true(x: Any) -> bool:
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true as known
    except ImportError:  # pragma: no cover - older torch
        return x is True
    return bool(known(x))


def sym_eq(a: Any, b: Any) -> Any:
    try:
        from torch.fx.experimental.symbolic_shapes import sym_eq as eq
    except ImportError:  # pragma: no cover - older torch
        return a == b
    return eq(a, b)


# Inductor's no-op rules (target -> (condition on fake args, source argument index or getter)).
# Checked on 2.13.0 (torch._inductor.fx_passes.post_grad.noop_registry, 34 entries); empty
# when inductor cannot be imported, and our own rules in noop.py still apply.
def inductor_noop_registry() -> dict[Any, tuple[Callable[..., bool], Any]]:
    try:
        from torch._inductor.fx_passes.post_grad import noop_registry
    except Exception:  # pragma: no cover - inductor unavailable
        return {}
    return dict(noop_registry)


# Fake arguments of a node from node.meta["val"]. Checked on 2.13.0.
def fake_args_kwargs(node: torch.fx.Node) -> tuple[bool, tuple[Any, ...], dict[str, Any]]:
    try:
        from torch._inductor.fx_utils import get_fake_args_kwargs
    except Exception:  # pragma: no cover
        return False, (), {}
    ok, args, kwargs = get_fake_args_kwargs(node)
    return bool(ok), tuple(args), dict(kwargs)


# Storage identity of a tensor (fake or real). Checked on 2.13.0.
def has_storage(t: torch.Tensor) -> bool:
    return bool(torch._C._has_storage(t))


def storage_key(t: torch.Tensor) -> int | None:
    if not has_storage(t):
        return None
    from torch.multiprocessing.reductions import StorageWeakRef

    return int(StorageWeakRef(t.untyped_storage()).cdata)  # type: ignore[no-untyped-call]

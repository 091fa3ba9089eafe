"""Graph keys and argument pickers, built once per callable from its InputSpec.

A graph key is a tuple: the values of the symbolic inputs and then their Python types (``2``,
``2.0`` and ``True`` are equal in a tuple, but a replay would repeat the captured type), then for
each tensor with every dim keyed (hand-written capture, where nothing else guards the tensor)
its rank, sizes, dtype and device (and, under autocast on the first such tensor's device type,
the autocast dtype; with grad mode on and a tensor input that requires grad, ``NEEDS_GRAD``; in
inference mode, ``INFERENCE``), and for each other keyed tensor the sizes of its keyed dims
(the backend's dynamo guards dtype, device, autocast, grad and inference mode). When nothing is
keyed the key is the constant ``()`` and no key function exists at all."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import itemgetter

import torch

from npugraph_runtime.spec import InputSpec, SlotKind

Args = tuple[object, ...]
Key = tuple[object, ...]
is_autocast_enabled, get_autocast_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype
is_grad_enabled, is_inference_mode_enabled = torch.is_grad_enabled, torch.is_inference_mode_enabled
# the last item of a hand-written key whose call needs autograd (see key_function): no capture
# serves such a key, the manager runs fn eagerly for it
NEEDS_GRAD = "needs_grad"
# the last item of a hand-written key called in inference mode: its capture's buffers and outputs
# are inference tensors, which a call outside inference mode may not write (nor may its caller)
INFERENCE = "inference"

_KEYED_TENSORS = (SlotKind.USER, SlotKind.MUTATED)
_TENSOR_KINDS = (SlotKind.STATIC, SlotKind.MUTATED, SlotKind.USER)


def picker(indices: Sequence[int]) -> Callable[[Args], tuple[object, ...]] | None:
    """``args -> tuple(args[i] for i in indices)`` at C speed; None when there is nothing to pick."""
    if not indices:
        return None
    first = indices[0]
    if list(indices) == list(range(first, first + len(indices))):
        return itemgetter(slice(first, first + len(indices)))  # a slice is 5x cheaper than a gather
    return itemgetter(*indices)


def key_function(spec: InputSpec) -> Callable[[Args], Key] | None:
    """The key of a call, or None when every call has the key ``()``."""
    symbolic = tuple(i for i, k in enumerate(spec.kinds) if k is SlotKind.SYMBOLIC)
    whole: list[int] = []
    dims: list[tuple[int, int]] = []
    tensors = [i for i, k in enumerate(spec.kinds) if k in _TENSOR_KINDS]
    for i, kind in enumerate(spec.kinds):
        if kind in _KEYED_TENSORS:
            keyed = spec.dims_keyed(i)
            if keyed is None:
                whole.append(i)
            else:
                dims.extend((i, d) for d in keyed)
    if not whole and not dims:
        if not symbolic:
            return None
        pick = picker(symbolic)
        assert pick is not None

        def scalar_key(args: Args) -> Key:
            values = pick(args)
            return (*values, *map(type, values))

        return scalar_key

    def key(args: Args) -> Key:
        k: list[object] = [args[i] for i in symbolic]
        k += [type(v) for v in k]
        for i in whole:
            t: torch.Tensor = args[i]  # type: ignore[assignment]
            shape = t.shape
            k.append(len(shape))
            k += shape
            k.append(t.dtype)
            k.append(t.device)
        for i, d in dims:
            k.append(args[i].shape[d])  # type: ignore[attr-defined]
        if whole:
            # hand-written keys: a capture repeats the autocast state it was recorded under (the
            # dtypes of its ops), so calls under another state get their own graph, as eager
            # would compute in other dtypes (Dynamo guards this state for the backend)
            device = args[whole[0]].device.type  # type: ignore[attr-defined]
            if is_autocast_enabled(device):
                k.append(get_autocast_dtype(device))
            # a replay's outputs have no autograd history: a call that needs it (grad mode on,
            # a tensor input requiring grad) gets a key of its own, which runs eagerly, as
            # x.grad would otherwise stay None (Dynamo guards grad mode for the backend)
            if is_grad_enabled():
                if any(args[i].requires_grad for i in tensors):  # type: ignore[attr-defined]
                    k.append(NEEDS_GRAD)
            elif is_inference_mode_enabled():
                k.append(INFERENCE)
        return tuple(k)

    return key

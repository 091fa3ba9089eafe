"""Every private torch API the runtime touches, each with the torch versions it was checked on.
A torch upgrade is a change to this file only. Every entry was also checked on torch 2.11.0
(Python 3.12, the CUDA wheel, where ``_tensors_data_ptrs_at_indices_equal`` exists with the
same signature): present with the same shape."""

from __future__ import annotations

import collections
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch


# --- ops.py: keep marker ops through FX dead-code elimination ----------------------------------
def mark_side_effectful(op: Any) -> None:
    """Checked on torch 2.13.0: ``torch.fx.node.has_side_effect`` (public, not backward-compatible
    tagged); older torch only had the private set ``torch.fx.node._side_effectful_functions``."""
    import torch.fx.node as fx_node

    register = getattr(fx_node, "has_side_effect", None)
    if register is not None:
        register(op)
    else:
        fx_node._side_effectful_functions.add(op)


# --- the capture manager: counters, batched copies and address checks on the replay path ----------
def npugraph_ex_counters() -> collections.Counter[str]:
    """Checked on torch 2.13.0 and 2.11: ``torch._dynamo.utils.counters`` is a
    ``defaultdict(Counter)``; without dynamo a process-local Counter stands in."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - dynamo ships with every supported torch
        return _LOCAL_COUNTERS
    return counters["npugraph_ex"]


_LOCAL_COUNTERS: collections.Counter[str] = collections.Counter()


def foreach_copy() -> Callable[[list[torch.Tensor], Sequence[torch.Tensor]], object]:
    """Checked on torch 2.13.0 and 2.11: ``torch._foreach_copy_(dsts, srcs)`` copies a list in one
    dispatch (one launch on CUDA); per-tensor ``copy_`` where it is missing."""
    op = getattr(torch, "_foreach_copy_", None)
    if op is not None:
        return cast(Callable[[list[torch.Tensor], Sequence[torch.Tensor]], object], op)

    def copy_each(dsts: list[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src)

    return copy_each


def data_ptrs_at_indices_equal() -> Callable[[list[object], list[int | None], list[int]], bool] | None:
    """Checked on torch 2.13.0: ``torch._C._tensors_data_ptrs_at_indices_equal`` exists in CUDA
    builds only (declared in the stubs, absent from the CPU wheel). torch_npu, which runs on a
    CPU build of torch, defines one of the same signature in ``torch_npu._C`` (from its sources;
    not run here: no Ascend machine); it is used where torch_npu is already imported. None where
    neither exists."""
    fn = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if fn is None:
        npu = sys.modules.get("torch_npu")
        fn = getattr(getattr(npu, "_C", None), "_tensors_data_ptrs_at_indices_equal", None)
    return cast(Callable[[list[object], list[int | None], list[int]], bool] | None, fn)


def storage_use_count() -> Callable[[int], int]:
    """Checked on torch 2.13.0 and 2.11: ``torch._C._storage_Use_Count(storage._cdata)`` is the
    C++ StorageImpl's strong use count (one per TensorImpl and per Python storage object using
    it); torch's cudagraph trees read it to tell whether a graph output is still alive."""
    return cast(Callable[[int], int], torch._C._storage_Use_Count)


# --- devices/cpu*.py: the emulated CPU device graph ------------------------------------
# Checked on torch 2.13.0 and 2.11: ``torch.utils._python_dispatch.TorchDispatchMode`` is the base
# class of dispatch modes (a thread-local mode stack, entered with ``with``).
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode  # noqa: E402


def no_torch_function() -> Any:
    """Checked on torch 2.13.0 and 2.11: ``torch._C.DisableTorchFunction()`` turns off
    ``__torch_function__`` handling, modes included, for its block; a no-op where missing."""
    disable = getattr(torch._C, "DisableTorchFunction", None)
    if disable is None:  # pragma: no cover
        import contextlib

        return contextlib.nullcontext()
    return disable()


def op_entry(overload: Any) -> Callable[..., Any]:
    """Checked on torch 2.13.0: ``OpOverload._op`` is the C++ operator handle that
    ``OpOverload.__call__`` forwards to; calling it directly skips one Python frame."""
    return cast(Callable[..., Any], getattr(overload, "_op", overload))


def public_op_namespaces() -> tuple[Any, ...]:
    """Checked on torch 2.13.0 and 2.11: the Python-arg-parser bindings behind ``torch.*``,
    ``torch.nn.functional``, ``torch.special``, ``torch.linalg`` and ``torch.fft`` (the fastest way
    to call an ATen op with ``out=``), by ATen name."""
    names = ("_VariableFunctions", "_nn", "_special", "_linalg", "_fft")
    return tuple(getattr(torch._C, n) for n in names if hasattr(torch._C, n))


def inference_mode_guard() -> Callable[[bool], Any]:
    """Checked on torch 2.13.0 and 2.11: ``torch._C._InferenceMode(True)`` is the RAII guard behind
    ``torch.inference_mode`` (a context manager, without the Python decorator machinery)."""
    guard = getattr(torch._C, "_InferenceMode", None)
    if guard is None:  # pragma: no cover
        return cast(Callable[[bool], Any], torch.inference_mode)
    return cast(Callable[[bool], Any], guard)


def storage_weak_ref(storage: torch.UntypedStorage) -> Any:
    """Checked on torch 2.13.0 and 2.11: ``torch.multiprocessing.reductions.StorageWeakRef`` (a weak
    reference to the C++ storage, not to its Python object)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(storage)  # type: ignore[no-untyped-call]


def storage_from_weak_ref(ref: Any) -> torch.UntypedStorage | None:
    """Checked on torch 2.13.0 and 2.11: ``UntypedStorage._new_with_weak_ptr`` turns a live weak
    storage reference back into a storage. None when the storage is gone."""
    if ref.expired():
        return None
    storage: torch.UntypedStorage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)  # type: ignore[attr-defined]
    return storage


def op_schema(overload: Any) -> Any:
    """Checked on torch 2.13.0 and 2.11: ``OpOverload._schema`` is the op's FunctionSchema
    (arguments with ``alias_info.is_write``, returns, name, overload_name)."""
    return overload._schema


def op_base_name(overload: Any) -> str:
    """Checked on torch 2.13.0 and 2.11: ``OpOverload._opname`` is the op name without namespace
    and overload ("add" for ``aten.add.Tensor``)."""
    return str(overload._opname)


def wait_tensor_op() -> Callable[..., Any]:
    """Checked on torch 2.13.0 and 2.11: ``torch.ops._c10d_functional.wait_tensor`` waits for an
    asynchronous functional collective's result."""
    return op_entry(torch.ops._c10d_functional.wait_tensor.default)


def is_higher_order(func: Any) -> bool:
    """Checked on torch 2.13.0: higher-order operators are ``torch._ops.HigherOrderOperator``."""
    return isinstance(func, torch._ops.HigherOrderOperator)


def higher_order_body(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                      ) -> Callable[[], Any] | None:
    """Checked on torch 2.13.0: a ``torch._ops.HigherOrderOperator``'s eager implementation as a
    call that may run under a dispatch mode, so that the mode sees the ATen ops of its body. The
    CompositeExplicitAutograd kernel of most (while_loop, map_impl, flex_attention, with_effects,
    auto_functionalized) runs the body; those of cond, scan and invoke_subgraph refuse an active
    mode, so their body is called as that kernel would: ``invoke_subgraph(subgraph, identifier,
    *operands)`` calls ``subgraph(*operands)``, ``cond(pred, true_fn, false_fn, operands)`` one
    of the two, ``scan`` is ``torch._higher_order_ops.scan.generic_scan``. None for anything else
    (an OpOverload, a HOP without an eager implementation)."""
    if not is_higher_order(func):
        return None
    name = func.name()
    if name == "invoke_subgraph":
        return lambda: args[0](*args[2:])
    if name == "cond" and len(args) == 4 and not kwargs:
        return lambda: (args[1] if args[0] else args[2])(*args[3])
    if name == "scan" and len(args) == 4 and not kwargs:
        from torch._higher_order_ops.scan import generic_scan

        return lambda: generic_scan(  # type: ignore[no-untyped-call]
            args[0], args[1], args[2], additional_inputs=args[3])
    kernel = func.py_kernels.get(torch._C.DispatchKey.CompositeExplicitAutograd)
    if kernel is None:
        return None
    return lambda: kernel(*args, **kwargs)


# --- bindings.py: profiler ranges only while a profiler records -----------------------------------
# torch.autograd.profiler._is_profiler_enabled: a module global every torch profiler sets on start
# and clears on stop, so the hot path pays one attribute read. Checked on torch 2.13.0 (present
# since 1.13); fallback: the C query, slower but correct.
import torch.autograd.profiler as _autograd_profiler  # noqa: E402

if hasattr(_autograd_profiler, "_is_profiler_enabled"):

    def profiler_enabled() -> bool:
        return bool(_autograd_profiler._is_profiler_enabled)

else:  # pragma: no cover - older torch

    def profiler_enabled() -> bool:
        return bool(torch.autograd._profiler_enabled())  # type: ignore[attr-defined]


# --- devices/no_launch.py: what a collective that is not launched returns -------------------------
def completed_work() -> Any:
    """Checked on torch 2.13.0: ``torch._C._distributed_c10d._create_work_from_future`` makes a
    ``Work`` of a completed future, and ``Work.boxed()`` the ScriptObject a ``c10d::*`` op returns
    (a plain ``FakeWork`` is refused there: it is no ScriptObject)."""
    from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]

    done: torch.futures.Future[None] = torch.futures.Future()
    done.set_result(None)
    return _create_work_from_future(done).boxed()


def fake_results(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Checked on torch 2.13.0: ``func`` run under ``torch._subclasses.FakeTensorMode`` on fake
    copies of its tensors gives its results' sizes, strides, dtypes and devices without running it
    (the ``_c10d_functional`` ops have fake kernels; a meta tensor is refused by them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map_only

    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
        return func(*fake[0], **fake[1])


# --- devices/cpu_recorder.py: functional collectives' lazy results in a hand-written capture ------
@functools.cache
def _async_collective_type() -> type | None:
    """Checked on torch 2.13.0: ``torch.distributed._functional_collectives.AsyncCollectiveTensor``
    wraps a functional collective's result (``elem``, ``completed``) and waits on it in its own
    ``__torch_dispatch__`` when first used, where a dispatch mode no longer sees the wait."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return cast(type, AsyncCollectiveTensor)


def resolve_async_collectives(
    args: tuple[Any, ...], kwargs: dict[str, Any], wait: Callable[[Any], torch.Tensor],
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """``args`` and ``kwargs`` with each AsyncCollectiveTensor (at the top or in a list) replaced
    by ``wait(it)``; None when there is none."""
    kind = _async_collective_type()
    if kind is None:
        return None

    def found(v: Any) -> bool:
        return type(v) is kind or (type(v) in (list, tuple) and any(type(x) is kind for x in v))

    if not any(map(found, args)) and not any(map(found, kwargs.values())):
        return None

    def swap(v: Any) -> Any:
        if type(v) is kind:
            return wait(v)
        if type(v) in (list, tuple) and any(type(x) is kind for x in v):
            return type(v)(swap(x) for x in v)
        return v

    return tuple(map(swap, args)), {k: swap(v) for k, v in kwargs.items()}


def wait_tensor_overload() -> Any:
    """Checked on torch 2.13.0 and 2.11: the OpOverload ``_c10d_functional.wait_tensor.default``."""
    return torch.ops._c10d_functional.wait_tensor.default


def wait_work(work: Any) -> None:
    """Checked on torch 2.13.0: a ``c10d::*`` op returns its Work boxed (a ScriptObject);
    ``Work.unbox`` gives the Python Work, whose ``wait()`` may be called again by its caller."""
    from torch._C._distributed_c10d import Work  # type: ignore[attr-defined]

    Work.unbox(work).wait()


def compiling() -> bool:
    """Checked on torch 2.13.0 and 2.11: this thread is tracing the code that calls it for
    torch.compile (or export). ``torch.compiler.is_compiling()`` alone reads a process-wide flag
    that torch holds for a whole compile session, so while one thread compiles it is True in
    every other thread too. ``is_dynamo_compiling()`` is folded to True by dynamo's trace (False
    when run); the rest of a compile session (AOT, the backend) holds ``CompileContext``, which is
    per thread."""
    if torch.compiler.is_dynamo_compiling():
        return True
    return torch.compiler.is_compiling() and torch._guards.CompileContext.try_get() is not None

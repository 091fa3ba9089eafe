"""Collectives in a CPU capture: a replay issues each one where the graph issued it and waits
where the graph waited.

torch's functional collectives (``_c10d_functional.*``) are asynchronous: the op returns at once,
the process group's worker fills the result, and ``wait_tensor`` on the result (looked up by its
storage) blocks until it is there. ``wait_tensor`` returns its own argument, so to the recorder it
looks like a view; it must still be re-issued, or the op after it reads a collective still in
flight. Two forms reach a capture:

* in place (``all_reduce_``, ``broadcast_``, ``all_gather_into_tensor_out``): re-issued as they
  are, and ``wait_tensor`` on the written tensor re-issued at its place;
* functional (``all_reduce``, ``all_gather_into_tensor``, ...): the result is a fresh tensor at
  every replay; it is kept in a local of the replay function and copied into the recorded output
  at the graph's wait (a graph reads a collective's result only after waiting on it).

The inputs a collective reads (gloo reads them on its own thread) stay alive and untouched until
its wait: the recorder extends their lifetime in the pool plan to the wait.

``torch.distributed``'s own calls in a hand capture (``dist.all_reduce``) dispatch ``c10d::*`` ops
that return a ``Work``; the user's ``work.wait()`` is no ATen op, so the recorder never sees it:
a replay waits on the Work as soon as the op returns (never later than the user did)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

from npugraph_runtime import _compat

_NAMESPACES = frozenset({"_c10d_functional"})
_WAIT = "wait_tensor"


def is_wait(func: Any) -> bool:
    return func.namespace in _NAMESPACES and _compat.op_base_name(func) == _WAIT


def is_collective(func: Any) -> bool:
    return func.namespace in _NAMESPACES and _compat.op_base_name(func) != _WAIT


@cache
def work_path(func: Any) -> str | None:
    """Where the ``Work`` is in the result of a ``c10d::*`` op ("" or "[i]"), None if it has
    none (functional collectives return tensors only)."""
    returns = _compat.op_schema(func).returns
    for i, ret in enumerate(returns):
        if "Work" in str(ret.type):
            return "" if len(returns) == 1 else f"[{i}]"
    return None


class InFlight:
    """Recording: which storages each collective not yet waited on reads."""

    def __init__(self) -> None:
        self._reads: dict[int, set[int]] = {}  # written storage -> storages it reads

    def issued(self, writes: set[int], reads: set[int]) -> None:
        for s in writes:
            self._reads[s] = reads

    def waited(self, storage: int | None) -> set[int]:
        """Storages that must live until this wait (the collective's inputs)."""
        if storage is None:
            return set()
        return self._reads.pop(storage, set())


class Emitter:
    """Replay generation: lines for collectives and their waits (``names``/``res`` are the
    replay generator's name binder and resolver)."""

    def __init__(self, names: Any, res: Any, tensors: Sequence[Any]) -> None:
        self._names = names
        self._res = res
        self._tensors = tensors
        self._pending: dict[int, tuple[str, Any]] = {}  # output storage -> (local expr, TRef)
        self._count = 0

    def _wait(self) -> str:
        return str(self._names.bind(_compat.wait_tensor_op()))

    def collective(self, call: str, outs: Sequence[tuple[tuple[int, ...], Any]]) -> list[str]:
        local = f"c{self._count}"
        self._count += 1
        for path, ref in outs:
            where = local + "".join(f"[{i}]" for i in path)
            self._pending[self._tensors[ref.i].storage] = (where, ref)
        return [f"{local} = {call}"]

    def issue_and_wait(self, call: str, path: str) -> list[str]:
        """A ``c10d::*`` op: issue it and wait on its Work at once (see the module docstring)."""
        return [f"r = {call}", f"r{path}.wait()"]

    def _land(self, where: str, ref: Any) -> list[str]:
        copy = self._names.bind(self._res.tensor(ref).copy_)
        return [f"{self._wait()}({where})", f"{copy}({where})"]

    def wait(self, args: Sequence[Any]) -> list[str]:
        ref = args[0]
        pending = self._pending.pop(self._tensors[ref.i].storage, None)
        if pending is not None:
            return self._land(*pending)
        return [f"{self._wait()}({self._names.expr(self._res.tensor(ref))})"]

    def finish(self) -> list[str]:
        """Waits for functional collectives the graph never waited on: a replay returns with
        every result in place and no work left in torch's registry."""
        lines = [line for where, ref in self._pending.values() for line in self._land(where, ref)]
        self._pending.clear()
        return lines

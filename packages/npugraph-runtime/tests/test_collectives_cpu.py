"""Collectives in a hand-captured CPU graph (one gloo rank on 127.0.0.1, in this process): a
replay issues each collective where the capture did and waits where the capture waited. The
2-rank behaviour (skewed ranks, every collective, faults) is tested with the backend in
packages/npugraph-backend/tests/test_distributed.py."""

from __future__ import annotations

import datetime
import re
import socket
from collections.abc import Callable, Iterator
from typing import Any

import npugraph_runtime as ngr
import pytest
import torch
import torch.distributed as dist
from npugraph_runtime import _compat

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")
F = torch.ops._c10d_functional if dist.is_available() else None


@pytest.fixture(scope="module")
def group() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def capture(fn: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    g = ngr.Graph("cpu")
    with torch.no_grad(), ngr.graph(g):
        out = fn(*args)
    return g, out


def _ops(g: Any) -> list[str]:
    """The replay's lines with each bound name replaced by what it is bound to: the op or
    method's name, ``T`` for a tensor (the generated function binds its objects as default
    arguments). How an ATen op is re-issued (``out=``, an operator handle, compute-and-copy) is
    chosen by timing, so tests look at the place of the collectives' lines, not at the others."""
    replay = g._replay
    code = replay.__code__
    bound = dict(zip(code.co_varnames[:code.co_argcount], replay.__defaults__, strict=True))
    ops = {id(_compat.op_entry(getattr(F, n).default)): n
           for n in ("all_reduce_", "all_reduce", "all_gather_into_tensor", "wait_tensor")}

    def show(match: re.Match[str]) -> str:
        obj = bound.get(match.group(0))
        if obj is None:
            return match.group(0)
        if id(obj) in ops:
            return ops[id(obj)]
        return "T" if isinstance(obj, torch.Tensor) else str(getattr(obj, "__name__", "?"))

    return [re.sub(r"\bv\d+\b", show, line.strip())
            for line in g.replay_source().splitlines()[2:]]


def _first(ops: list[str], needle: str) -> int:
    return next(i for i, line in enumerate(ops) if needle in line)


def test_inplace_collective_is_waited_where_the_graph_waits(group: str) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        F.all_reduce_(y, "sum", group)
        F.wait_tensor(y)
        return y + 1

    x = torch.randn(3, 4, 5)
    g, out = capture(fn, x)
    # wait_tensor returns its argument, so it once was dropped as a view: the next op then
    # read a collective still in flight
    ops = _ops(g)
    issued = _first(ops, "all_reduce_(")
    assert ops[issued + 1] == "wait_tensor(T)" and len(ops) > issued + 2, ops  # then the add
    for _ in range(5):
        x.copy_(torch.randn(3, 4, 5))
        g.replay()
        assert torch.equal(out, fn(x))


def test_functional_result_lands_at_its_wait(group: str) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        gathered = F.all_gather_into_tensor(x * 3, 1, group)
        other = x.sin()  # runs while the collective is in flight
        return F.wait_tensor(gathered) + other

    x = torch.randn(2, 3)
    g, out = capture(fn, x)
    # issued where the capture issued it, its result copied into place at the wait
    ops = _ops(g)
    issued, waited = _first(ops, "c0 = all_gather_into_tensor("), _first(ops, "wait_tensor(c0)")
    assert issued + 1 < waited, ops  # the sin runs while the collective is in flight
    assert ops[waited + 1] == "copy_(c0)" and len(ops) > waited + 2, ops  # then the add
    for _ in range(5):
        x.copy_(torch.randn(2, 3))
        g.replay()
        assert torch.equal(out, fn(x))


def test_functional_collective_never_waited_is_waited_before_the_replay_returns(group: str) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.all_reduce(x + 1, "sum", group)

    x = torch.randn(4)
    g, out = capture(fn, x)
    F.wait_tensor(out)  # the capture's own run of the collective
    assert _ops(g)[-2:] == ["wait_tensor(c0)", "copy_(c0)"], _ops(g)
    for _ in range(5):
        x.copy_(torch.randn(4))
        g.replay()
        assert torch.equal(out, x + 1)


def test_dist_collective_waits_on_its_work_at_replay(group: str) -> None:
    # dist.all_reduce dispatches c10d::allreduce_, which returns a Work; the user's wait() on it
    # is no op the capture sees, so the replay waits right after issuing it
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    x = torch.randn(3, 4)
    g, out = capture(fn, x)
    ops = _ops(g)
    issued = next(i for i, o in enumerate(ops) if o.startswith("r = "))
    assert ops[issued + 1] == "r[1].wait()", ops
    for _ in range(5):
        x.copy_(torch.randn(3, 4))
        g.replay()
        assert torch.equal(out, x * 2 + 1)


def test_collective_input_is_not_reused_by_the_pool_before_its_wait(group: str) -> None:
    # gloo reads the input of an all_gather on its own thread until the wait: the intermediate
    # computed meanwhile must not be placed in the input's bytes
    def fn(x: torch.Tensor) -> torch.Tensor:
        gathered = F.all_gather_into_tensor(x * 3, 1, group)
        other = x.sin()
        return F.wait_tensor(gathered) + other

    x = torch.randn(64, 64)
    g, _ = capture(fn, x)
    replay = g._replay
    code = replay.__code__
    bound = dict(zip(code.co_varnames[:code.co_argcount], replay.__defaults__, strict=True))
    raw = [line.strip() for line in g.replay_source().splitlines()[2:]]
    ops = _ops(g)
    gather = raw[_first(ops, "c0 = all_gather_into_tensor(")]
    collective_input = bound[gather.split("(")[1].split(",")[0]]
    sin = raw[_first(ops, "c0 = all_gather_into_tensor(") + 1]
    if "out=" in sin:
        meanwhile = bound[sin.split("out=")[1].rstrip(")")]
    else:  # re-issued as compute-and-copy: <target>.copy_(sin(x))
        meanwhile = bound[sin.split("(")[0]].__self__
    start = collective_input.data_ptr()
    end = start + collective_input.numel() * collective_input.element_size()
    assert not start <= meanwhile.data_ptr() < end


def test_a_lazy_functional_result_is_waited_on_before_its_first_use(group: str) -> None:
    # torch.distributed._functional_collectives returns an AsyncCollectiveTensor, which waits in
    # its own __torch_dispatch__, where the recorder does not see it: the wait was emitted at the
    # end of the replay, after the add had read the previous replay's result
    import torch.distributed._functional_collectives as fc

    def fn(x: torch.Tensor) -> torch.Tensor:
        return fc.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

    x = torch.randn(3, 4)
    g, out = capture(fn, x)
    ops = _ops(g)
    assert _first(ops, "wait_tensor(c0)") < _first(ops, "add"), ops
    for _ in range(5):
        x.copy_(torch.randn(3, 4))
        g.replay()
        assert torch.equal(out, x * 2 + 1)

"""One rank of test_collectives_once_strided.py (2 gloo ranks on 127.0.0.1; torch and
npugraph_runtime only).

    python collectives_once_strided_worker.py RANK PORT OUT_JSON

fn issues collectives both before and after it reads an input through as_strided, on rank 0
only (rank 1 reads it plainly). A CPU capture whose run finds such a read is made again with a
buffer mirroring the input's storage; the collectives its first run launched before the read must
not be launched again in that call. Every call is followed by the same call of fn eagerly on both
ranks, so the ranks stay in step only if each captured call issued exactly eager's collectives;
each call's collectives (the process group's sequence number), result, mutated input and fn's own
step counter are compared with eager's, and the results kept on rank 0 are checked at the end."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import npugraph_runtime as ngr
import torch
import torch.distributed as dist
from collectives_once_worker import _issued, _scenario, init, run_scenarios
from npugraph_runtime.spec import CapturePolicy, InputSpec

CALLS = 6  # as collectives_once_worker's _scenario


def _fn(strided: bool, functional_op: bool = False) -> tuple[Callable[..., torch.Tensor], torch.Tensor]:
    steps = torch.zeros(())

    def fn(x: torch.Tensor, cache: torch.Tensor, n: int) -> torch.Tensor:
        steps.add_(1)
        cache.mul_(n)
        dist.all_reduce(cache)  # before the read: in place, applied twice it doubles the sum
        if functional_op:
            s = torch.ops._c10d_functional.all_reduce(cache * 3, "sum", "0")
            cache.add_(torch.ops._c10d_functional.wait_tensor(s))
        y = (x.as_strided((3, 4), (4, 1)) if strided else x) + cache
        dist.all_reduce(y)  # after it
        return y * 2

    return fn, steps


def _world_size_read(x: torch.Tensor) -> torch.Tensor:
    n = torch.ones(())
    dist.all_reduce(n)  # the world size, on every call
    return x * n.item()


def _relaxed_host_read(rank: int) -> dict[str, Any]:
    """capture_error_mode='relaxed' freezes a host read: in a capture whose collectives stand in
    for themselves it froze this rank's own value (1, not the world size 2)."""
    errors: dict[str, str] = {}
    counts: list[int] = []
    for name, policy in (("by_hand", {}), ("warmup_0", {"warmup": 0}),
                         ("force_recapture", {"force_recapture": True})):
        compiled = ngr.make_graphed_callable(_world_size_read, (torch.ones(3),),
                                             capture_error_mode="relaxed", **policy)
        before = _issued()
        try:
            compiled(torch.ones(3))
            errors[name] = "no error"
        except ngr.CaptureError as e:
            errors[name] = str(e)
        counts.append(_issued() - before)
    # where the capture is the call's run, the value is the collective's, as eager's
    spec = InputSpec.infer((torch.ones(3),), (), ())
    compiled = ngr.GraphedCallable(_world_size_read, spec, CapturePolicy(
        name=f"relaxed_{rank}", capture_error_mode="relaxed"), functional=True)
    bad = []
    for i in range(CALLS):
        x = torch.full((3,), float(i))
        before = _issued()
        got = compiled(x)
        counts.append(_issued() - before)
        if not torch.equal(got, _world_size_read(x)):
            bad.append(i)
    return {"errors": errors, "counts": counts, "bad": bad, "captures": compiled.num_captures}


def main() -> None:
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    init(rank, port)
    same = lambda i: 2  # noqa: E731
    new_keys = (lambda i: i + 1) if rank == 0 else same
    strided = rank == 0  # only rank 0's first capture is made again
    both = partial(_fn, functional_op=True)
    runs: dict[str, Callable[[], dict[str, Any]]] = {
        "functional_new_keys": lambda: _scenario(rank, new_keys, rank == 0, strided, True,
                                                 make=_fn),
        "functional_same_key_held": lambda: _scenario(rank, same, rank == 0, strided, True,
                                                      make=_fn),
        "functional_op_before": lambda: _scenario(rank, new_keys, rank == 0, strided, True,
                                                  make=both),
        "by_hand_held": lambda: _scenario(rank, same, rank == 0, strided, make=_fn),
        "by_hand_warmup_0": lambda: _scenario(rank, new_keys, rank == 0, strided, make=_fn,
                                              warmup=0),
        "both_ranks_strided": lambda: _scenario(rank, same, rank == 0, True, True, make=_fn),
        "relaxed_host_read": lambda: _relaxed_host_read(rank),
    }
    run_scenarios(runs, out)


if __name__ == "__main__":
    main()

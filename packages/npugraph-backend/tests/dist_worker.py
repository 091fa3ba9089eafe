"""One rank of the 2-process gloo tests (test_distributed.py starts two of these on 127.0.0.1).

    python dist_worker.py RANK PORT OUT_JSON SUITE

SUITE "collectives": every scenario below, compiled with backend="npugraph_ex", called CALLS times
with fresh inputs while rank 1 arrives late on every call, each output compared with eager; the
result per scenario goes to OUT_JSON. SUITE "dead_peer"/"timeout": rank 1 vanishes (exits / stops
calling) after a few replays; rank 0 records how its next call failed and how long it took.
SUITE "nccl": the captured scenarios on cuda:RANK with NCCL (CUDA graphs), needs 2 GPUs.
SUITE "capture_decisions": scenarios where the ranks make different capture decisions for the
same call (see capture_decisions), DECISION_CALLS calls each."""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

CALLS = 21  # the first call warms up and captures: 20 replays follow
SKEW_S = 0.004  # rank 1 calls this much later than rank 0, every call
WORLD = 2
FAULT_TIMEOUT_S = 5
DECISION_CALLS = 8  # capture_decisions: the tests count captures per this many calls


def _counters() -> dict[str, int]:
    return dict(torch._dynamo.utils.counters["npugraph_ex"])


def _split(rank: int) -> tuple[list[int], list[int]]:
    """Uneven all_to_all splits of 4 rows: (output splits, input splits) of this rank."""
    inputs = [[1, 3], [2, 2]]
    return [inputs[j][rank] for j in range(WORLD)], inputs[rank]


def scenarios(rank: int) -> dict[str, tuple[Callable[..., Any], Callable[[int], list[torch.Tensor]]]]:
    group = dist.group.WORLD
    out_splits, in_splits = _split(rank)

    def fresh(*shape: int) -> Callable[[int], list[torch.Tensor]]:
        return lambda i: [torch.randn(*shape) + rank * 10 + i]

    def fc_all_reduce(x: torch.Tensor) -> torch.Tensor:
        return fc.all_reduce(x * 2, "sum", group) + 1

    def dist_all_reduce(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    def fc_all_reduce_chain(x: torch.Tensor) -> torch.Tensor:
        # two collectives in flight at once, their inputs and results read after the waits
        a = fc.all_reduce(x.sin(), "sum", group)
        b = fc.all_reduce(x.cos(), "max", group)
        return a * b + x

    def fc_all_gather(x: torch.Tensor) -> torch.Tensor:
        return fc.all_gather_tensor(x + 1, 0, group) * 3

    def dist_all_gather(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(WORLD * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(out, x + 1)
        return out * 3

    def fc_reduce_scatter(x: torch.Tensor) -> torch.Tensor:
        return fc.reduce_scatter_tensor(x * 2, "sum", 0, group) - 1

    def dist_reduce_scatter(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0] // WORLD, *x.shape[1:])
        dist.reduce_scatter_tensor(out, x * 2)
        return out - 1

    def fc_all_to_all_even(x: torch.Tensor) -> torch.Tensor:
        return fc.all_to_all_single(x * 2, None, None, group) + x

    def fc_all_to_all_uneven(x: torch.Tensor) -> torch.Tensor:
        return fc.all_to_all_single(x * 2, out_splits, in_splits, group) * 2

    def dist_all_to_all_uneven(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x * 2, out_splits, in_splits)
        return out * 2

    def fc_broadcast(x: torch.Tensor) -> torch.Tensor:
        return fc.broadcast(x * 2, 0, group) + 1


    torch.manual_seed(0)  # the same weights on both ranks, then each keeps its shard
    w1, w2 = torch.randn(16, 32) / 4, torch.randn(32, 16) / 4
    cols = slice(rank * 16, (rank + 1) * 16)
    w1_shard, w2_shard = w1[:, cols].contiguous(), w2[cols].contiguous()

    def tp_mlp(x: torch.Tensor) -> torch.Tensor:
        # column-parallel up, row-parallel down, all_reduce of the partial sums
        h = torch.relu(x @ w1_shard)
        y = h @ w2_shard
        dist.all_reduce(y)
        return y + x

    return {
        "fc_all_reduce": (fc_all_reduce, fresh(3, 4, 5)),
        "dist_all_reduce": (dist_all_reduce, fresh(3, 4, 5)),
        "fc_all_reduce_chain": (fc_all_reduce_chain, fresh(2, 6, 3)),
        "fc_all_gather": (fc_all_gather, fresh(2, 3, 4)),
        "dist_all_gather": (dist_all_gather, fresh(2, 3, 4)),
        "fc_reduce_scatter": (fc_reduce_scatter, fresh(4, 3, 2)),
        "dist_reduce_scatter": (dist_reduce_scatter, fresh(4, 3, 2)),
        "fc_all_to_all_even": (fc_all_to_all_even, fresh(4, 3, 2)),
        "fc_all_to_all_uneven": (fc_all_to_all_uneven, fresh(4, 3, 2)),
        "dist_all_to_all_uneven": (dist_all_to_all_uneven, fresh(4, 3, 2)),
        "fc_broadcast": (fc_broadcast, fresh(3, 4, 5)),
        "tp_mlp": (tp_mlp, fresh(5, 16)),
    }


def _skew(rank: int) -> None:
    if rank == 1:
        time.sleep(SKEW_S)


def run_scenario(
    rank: int, fn: Callable[..., Any], make: Callable[[int], list[torch.Tensor]],
    options: dict[str, Any], fullgraph: bool = True,
) -> dict[str, Any]:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(fn, backend="npugraph_ex", fullgraph=fullgraph, dynamic=False,
                             options=options)
    bad, worst = 0, 0.0
    for i in range(CALLS):
        args = make(i)
        _skew(rank)
        got = compiled(*[a.clone() for a in args])
        got = got.clone()  # the next replay overwrites the static output
        _skew(rank)
        want = fn(*[a.clone() for a in args])
        if not torch.equal(got, want):
            bad += 1
            worst = max(worst, float((got - want).abs().max()))
    counters = _counters()
    return {
        "bad": bad,
        "worst": worst,
        "calls": CALLS,
        "captured": sum(v for k, v in counters.items() if k.startswith("captured_")),
        "fallbacks": sum(v for k, v in counters.items() if k.startswith("eager_fallback")),
    }


def _send_recv(rank: int) -> dict[str, Any]:
    """send/recv: dynamo does not trace them (graph break), so they run eagerly between two
    captured graphs; what matters is that the result stays right."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        if rank == 0:
            dist.send(y, 1)
        else:
            dist.recv(y, 0)
        return y + 1

    return run_scenario(rank, fn, lambda i: [torch.randn(3, 4) + i], {}, fullgraph=False)


def _hand_capture(rank: int) -> dict[str, Any]:
    """torch.distributed's own dist.all_reduce in a capture by hand (npugraph_runtime.graph):
    its Work's wait() is no op the capture sees; every replay must still be complete."""
    import npugraph_runtime as ngr

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        dist.all_reduce(y)
        return y.sin() + y

    static = torch.randn(64, 64)
    g = ngr.Graph("cpu")
    with torch.no_grad(), ngr.graph(g):
        out = fn(static)
    bad = 0
    for i in range(CALLS):
        static.copy_(torch.randn(64, 64) + rank + i)
        _skew(rank)
        g.replay()
        got = out.clone()
        _skew(rank)
        bad += not torch.equal(got, fn(static))
    return {"bad": bad, "calls": CALLS, "captured": 1, "fallbacks": 0}


def _per_rank_dumps(rank: int) -> dict[str, Any]:
    """Data dump folders named by world size and rank, and one debug folder per rank under
    the shared TORCH_COMPILE_DEBUG_DIR the test gave both ranks, filled from the process group."""
    root = tempfile.mkdtemp(prefix=f"npugraph_dump_r{rank}_")
    torch._dynamo.reset()
    group = dist.group.WORLD
    compiled = torch.compile(lambda x: fc.all_reduce(x + 1, "sum", group) * 2, backend="npugraph_ex",
                             options={"dump_tensor_data": True, "data_dump_dir": root})
    os.environ["TORCH_COMPILE_DEBUG"] = "1"  # read at each compile by the backend
    try:
        compiled(torch.ones(2, 3))
    finally:
        os.environ["TORCH_COMPILE_DEBUG"] = "0"
    dist.barrier()  # both ranks have written their debug folders
    runs = os.path.join(os.environ["TORCH_COMPILE_DEBUG_DIR"], "torch_compile_debug")
    debug = [d.rsplit("-", 1)[-1] for d in sorted(os.listdir(runs))
             if os.path.isdir(os.path.join(runs, d, "npugraph_ex"))]
    return {"dump_dirs": sorted(os.listdir(root)), "debug_dirs": sorted(debug)}


def _changed_group(rank: int) -> dict[str, Any]:
    """A graph captured under one process group, called after it was replaced by another. The
    group is named by its string (dynamo guards a group object, and would recompile)."""
    torch._dynamo.reset()
    name = dist.group.WORLD.group_name
    compiled = torch.compile(lambda x: fc.all_reduce(x + 1, "sum", name) * 2,
                             backend="npugraph_ex", fullgraph=True)
    for _ in range(3):
        compiled(torch.ones(2, 3))
    dist.barrier()
    dist.destroy_process_group()
    _init(rank, int(os.environ["NPUGRAPH_TEST_PORT2"]), 30)
    try:
        compiled(torch.ones(2, 3))
    except Exception as e:  # the test inspects the type and message
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def dist_broadcast(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    dist.broadcast(y, 1)
    return y + 1


def collectives(rank: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    runs: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    for name, (fn, make) in scenarios(rank).items():
        runs.append((name, lambda fn=fn, make=make: run_scenario(rank, fn, make, {})))
        if name in ("fc_all_reduce", "dist_all_reduce", "tp_mlp"):
            runs.append((name + "/inplace_pass=False",
                         lambda fn=fn, make=make: run_scenario(rank, fn, make, {"inplace_pass": False})))
    # dynamo (torch 2.13) does not trace dist.broadcast (BroadcastOptions) nor send/recv: they
    # break the graph and run eagerly between two captured graphs, which must stay right
    runs += [("dist_broadcast", lambda: run_scenario(
                 rank, dist_broadcast, lambda i: [torch.randn(3, 4, 5) + rank + i], {},
                 fullgraph=False)),
             ("send_recv", lambda: _send_recv(rank)),
             ("hand_capture_dist_all_reduce", lambda: _hand_capture(rank)), ("dumps", lambda: _per_rank_dumps(rank)),
             ("changed_group", lambda: _changed_group(rank))]
    for name, run in runs:
        try:
            results[name] = run()
        except Exception:  # the test fails with it; the ranks stay in step
            results[name] = {"crash": traceback.format_exc()[-1500:]}
    return results


def fault(rank: int, how: str) -> dict[str, Any]:
    """Rank 1 goes away (exits, or stops calling) after 5 replays, or, for "capture_timeout",
    before rank 0's first call, so that rank 0's capture times out (on the CPU a compiled graph's
    first call runs only its capture: no eager warm-up run comes first)."""
    group = dist.group.WORLD

    def fn(x: torch.Tensor) -> torch.Tensor:
        return fc.all_reduce(x * 2, "sum", group) + 1

    compiled = torch.compile(fn, backend="npugraph_ex", fullgraph=True)
    if how != "capture_timeout":
        for _ in range(5):
            compiled(torch.ones(4))
        dist.barrier()
    if rank == 1:
        if how == "dead_peer":
            os._exit(0)
        time.sleep(FAULT_TIMEOUT_S * 3)
        os._exit(0)
    start = time.monotonic()
    try:
        for _ in range(3):
            compiled(torch.ones(4))
    except Exception as e:  # the test inspects the type and message
        return {"error": type(e).__name__, "message": str(e)[:300],
                "seconds": time.monotonic() - start,
                "captured": sum(v for k, v in _counters().items() if k.startswith("captured_"))}
    return {"error": None, "seconds": time.monotonic() - start}


def _issued() -> int:
    return int(dist.group.WORLD._get_sequence_number_for_group())


def _scenario(rank: int, fn: Callable[..., torch.Tensor], make: Callable[[int], list[torch.Tensor]],
              keep: bool, by_hand: bool = False, options: dict[str, Any] | None = None,
              fullgraph: bool = True, dynamic: bool = False) -> dict[str, Any]:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    if by_hand:  # npugraph_runtime's capture manager around the eager function
        import npugraph_runtime as ngr

        compiled = ngr.make_graphed_callable(fn, tuple(make(0)), name="by_hand")
    else:
        compiled = torch.compile(fn, backend="npugraph_ex", fullgraph=fullgraph, dynamic=dynamic,
                                 options=options or {})
    bad: list[int] = []
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    # the collectives this rank issued in each call, compiled and eager: the same, or a rank
    # that captures on a call the other does not would put the ranks out of step
    counts: list[int] = []
    eager_counts: list[int] = []
    for i in range(DECISION_CALLS):
        args = make(i)
        eager_args = [a.clone() for a in args]
        before = _issued()
        got = compiled(*args)
        counts.append(_issued() - before)
        before = _issued()
        want = fn(*eager_args)
        eager_counts.append(_issued() - before)
        if not torch.equal(got, want) or not all(
                torch.equal(a, b) for a, b in zip(args, eager_args, strict=True)):
            bad.append(i)
        if keep:
            kept.append((got, want))
        del got  # rank 1 holds nothing across calls
    stale = [i for i, (got, want) in enumerate(kept) if not torch.equal(got, want)]
    counters = _counters()
    return {"bad": bad, "stale": stale, "counts": counts, "eager_counts": eager_counts,
            "captured": sum(v for k, v in counters.items() if k.startswith("captured_")),
            "held": sum(v for k, v in counters.items() if k.startswith("capture_due_to_held")),
            "mutated": sum(v for k, v in counters.items()
                           if k.startswith("recapture_due_to_mutated_input_change")),
            "forced": sum(v for k, v in counters.items()
                          if k.startswith("recapture_due_to_force_recapture")),
            "new_keys": sum(v for k, v in counters.items() if k.startswith("capture_due_to_new_key")),
            "copied": sum(v for k, v in counters.items() if k.startswith("copied_inputs")),
            "eager": sum(v for k, v in counters.items() if k.startswith(("eager_", "eager_fallback")))}


def _fresh(rank: int) -> Callable[[int], list[torch.Tensor]]:
    return lambda i: [torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * i + rank))]


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    dist.all_reduce(y)
    return y + 1


def strided_all_reduce(x: torch.Tensor) -> torch.Tensor:
    # read through as_strided: the capture is made again with a buffer mirroring x's storage
    y = x.as_strided((2, 2), (1, 3), 1) * 2
    dist.all_reduce(y)
    return y + 1


def cached_all_reduce(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    cache.mul_(0.5).add_(x)
    y = cache * 3
    dist.all_reduce(y)
    return y - x


def all_reduce_input(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)  # in place on the caller's tensor: applied twice, world_size x the sum
    return x * 2


def broken_all_reduces(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    dist.all_reduce(y)
    torch._dynamo.graph_break()
    z = y.sin()
    dist.all_reduce(z)
    return z + 1


def keyed_all_reduce(x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    y = x * 2 + extra.sum()  # extra's length is the graph key (dynamic=True)
    dist.all_reduce(y)
    return y


def capture_decisions(rank: int) -> dict[str, Any]:
    """The ranks make different capture decisions for the same call: rank 0 keeps every output
    it got (a new capture for held outputs), rank 1 drops them; rank 0 hands a graph a new KV
    cache tensor (a recapture for the mutated input's address), rank 1 keeps its one; the same
    held outputs with a graph that reads its input through as_strided (a capture made twice) and
    with a capture by hand (make_graphed_callable); force_recapture, capture_limit,
    clone_input=False, an input all_reduced in place, a graph break between two collectives, and
    rank 0 taking a new key (dynamic=True) on every call. Each call's outputs are compared with
    eager at once and again after the last call, and the collectives it issued on this rank (the
    process group's sequence number) with eager's."""
    caches = [torch.zeros(3, 4), torch.zeros(3, 4)]

    def with_cache(i: int) -> list[torch.Tensor]:
        # rank 0 alternates between two caches (keeping both), rank 1 uses one
        cache = caches[i % 2] if rank == 0 else caches[0]
        return [_fresh(rank)(i)[0], cache]

    def keyed(i: int) -> list[torch.Tensor]:
        # rank 0 takes a new key (extra's length) on every call, rank 1 replays its one
        n = i + 2 if rank == 0 else 3
        return [_fresh(rank)(i)[0], torch.randn(n, generator=torch.Generator().manual_seed(i))]

    results: dict[str, Any] = {}
    held = rank == 0
    runs = {
        "held_outputs_on_one_rank": lambda: _scenario(rank, all_reduce, _fresh(rank), rank == 0),
        "new_cache_on_one_rank": lambda: _scenario(rank, cached_all_reduce, with_cache, False),
        "held_outputs_on_one_rank_as_strided": lambda: _scenario(
            rank, strided_all_reduce, _fresh(rank), rank == 0),
        "held_outputs_on_one_rank_by_hand": lambda: _scenario(
            rank, all_reduce, _fresh(rank), rank == 0, by_hand=True),
        "force_recapture": lambda: _scenario(
            rank, all_reduce, _fresh(rank), False, options={"force_recapture": True}),
        "capture_limit_held_on_one_rank": lambda: _scenario(
            rank, all_reduce, _fresh(rank), held, options={"capture_limit": 2}),
        "clone_input_false_held_on_one_rank": lambda: _scenario(
            rank, all_reduce, _fresh(rank), held, options={"clone_input": False}),
        "input_all_reduced_held_on_one_rank": lambda: _scenario(
            rank, all_reduce_input, _fresh(rank), held),
        "input_all_reduced_force_recapture": lambda: _scenario(
            rank, all_reduce_input, _fresh(rank), False, options={"force_recapture": True}),
        "graph_break_held_on_one_rank": lambda: _scenario(
            rank, broken_all_reduces, _fresh(rank), held, fullgraph=False),
        "new_keys_on_one_rank": lambda: _scenario(rank, keyed_all_reduce, keyed, False,
                                                  dynamic=True),
        "new_keys_on_one_rank_held": lambda: _scenario(rank, keyed_all_reduce, keyed, held,
                                                       dynamic=True),
    }
    for name, run in runs.items():
        try:
            results[name] = run()
        except Exception:  # the test fails with it
            results[name] = {"crash": traceback.format_exc()[-1500:]}
            break  # the ranks are out of step: the next scenario would hang
    return results


def _init(rank: int, port: int, timeout_s: float) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=timeout_s))


def nccl(rank: int) -> dict[str, Any]:
    """The captured scenarios on this rank's GPU: tensors and weights are made there."""
    torch.set_default_device(f"cuda:{rank}")
    results: dict[str, Any] = {}
    for name, (fn, make) in scenarios(rank).items():
        try:
            results[name] = run_scenario(rank, fn, make, {})
        except Exception:
            results[name] = {"crash": traceback.format_exc()[-1500:]}
    return results


def main() -> None:
    rank, port, out, suite = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    timeout = 30 if suite in ("collectives", "nccl", "capture_decisions") else FAULT_TIMEOUT_S
    if suite == "nccl":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=timeout),
                                device_id=torch.device("cuda", rank))
    else:
        _init(rank, port, timeout)
    try:
        if suite == "collectives":
            result = collectives(rank)
        elif suite == "nccl":
            result = nccl(rank)
        elif suite == "capture_decisions":
            result = capture_decisions(rank)
        else:
            result = fault(rank, suite)
    except Exception:  # reported to the test, which fails with it
        result = {"crash": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(result, f)
    os._exit(0)  # skip the process group's teardown, which may wait on a peer that is gone


if __name__ == "__main__":
    main()

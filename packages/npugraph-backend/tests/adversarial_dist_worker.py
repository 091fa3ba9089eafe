"""One rank of test_adversarial_collectives.py (2 gloo ranks on 127.0.0.1).

    python adversarial_dist_worker.py RANK PORT OUT_JSON

Scenarios where the ranks make different capture decisions for the same call: rank 0 keeps
every output it got (a new capture for held outputs), rank 1 drops them; rank 0 hands a graph a
new KV cache tensor (a recapture for the mutated input's address), rank 1 keeps its one; the
same held outputs with a graph that reads its input through as_strided (a capture made twice) and
with a capture by hand (make_graphed_callable); force_recapture, capture_limit, clone_input=False,
an input all_reduced in place, a graph break between two collectives, and rank 0 taking a new key
(dynamic=True) on every call. Each call's outputs are compared with eager at once and again after
the last call, and the collectives it issued on this rank (the process group's sequence number)
with eager's."""

from __future__ import annotations

import datetime
import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

CALLS = 8


def _counters() -> dict[str, int]:
    return dict(torch._dynamo.utils.counters["npugraph_ex"])


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
    for i in range(CALLS):
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


def main() -> None:
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=20))
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
    chosen = sys.argv[4].split(",") if len(sys.argv) > 4 else list(runs)
    runs = {name: runs[name] for name in chosen}
    for name, run in runs.items():
        try:
            results[name] = run()
        except Exception:  # the test fails with it
            results[name] = {"crash": traceback.format_exc()[-1500:]}
            break  # the ranks are out of step: the next scenario would hang
    with open(out, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

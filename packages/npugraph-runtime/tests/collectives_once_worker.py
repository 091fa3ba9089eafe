"""One rank of test_collectives_once.py (2 gloo ranks on 127.0.0.1; torch and npugraph_runtime
only, as the runtime package's tests must).

    python collectives_once_worker.py RANK PORT OUT_JSON [SCENARIO,...]

Hand-written captures (make_graphed_callable) whose fn all_reduces a mutated input in place.
Every call of the captured fn is followed by the same call of fn eagerly, on both ranks, so the
ranks stay in step only if the captured call issued exactly the collectives eager does. Each
call counts the collectives this rank issued (the process group's sequence number) and compares
the result, the mutated input and a tensor fn writes besides its inputs with eager's."""

from __future__ import annotations

import datetime
import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

import npugraph_runtime as ngr
import torch
import torch.distributed as dist
from npugraph_runtime.spec import CapturePolicy, InputSpec

CALLS = 6


def _issued() -> int:
    return int(dist.group.WORLD._get_sequence_number_for_group())


def _fn(strided: bool = False) -> tuple[Callable[..., torch.Tensor], torch.Tensor]:
    """fn(x, cache, n) and the step counter it writes besides its inputs. ``strided``: fn reads
    x through as_strided (its first capture is made again, with a buffer mirroring x's
    storage)."""
    steps = torch.zeros(())

    def fn(x: torch.Tensor, cache: torch.Tensor, n: int) -> torch.Tensor:
        cache.add_((x.as_strided((3, 4), (4, 1)) if strided else x) * n)
        dist.all_reduce(cache)  # in place: applied twice it gives world_size x the sum
        return cache * 2 + x

    def fn_counting(x: torch.Tensor, cache: torch.Tensor, n: int) -> torch.Tensor:
        steps.add_(1)
        return fn(x, cache, n)

    return fn_counting, steps


FnMaker = Callable[[bool], tuple[Callable[..., torch.Tensor], torch.Tensor]]


def _scenario(rank: int, ns: Callable[[int], int], keep: bool, strided: bool = False,
              functional: bool = False, make: FnMaker = _fn, **policy: Any) -> dict[str, Any]:
    fn, steps = make(strided)
    ref, ref_steps = make(strided)
    gen = torch.Generator().manual_seed(rank)

    def fresh() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)

    x0, c0 = fresh()
    cache, ref_cache = c0.clone(), c0.clone()
    if functional:  # as the backend makes it: a new key's capture is the call's own run
        spec = InputSpec.infer((x0, cache, ns(0)), (), (1,))
        compiled = ngr.GraphedCallable(fn, spec, CapturePolicy(name=f"once_{rank}", **policy),
                                       functional=True)
    else:
        compiled = ngr.make_graphed_callable(fn, (x0, cache, ns(0)), mutated_argnums=(1,),
                                             name=f"once_{rank}", **policy)
    bad: list[int] = []
    counts: list[int] = []
    eager_counts: list[int] = []
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i in range(CALLS):
        x, c = fresh()
        cache.copy_(c)
        ref_cache.copy_(c)
        before = _issued()
        got = compiled(x, cache, ns(i))
        counts.append(_issued() - before)
        before = _issued()
        want = ref(x.clone(), ref_cache, ns(i))
        eager_counts.append(_issued() - before)
        if not (torch.equal(got, want) and torch.equal(cache, ref_cache)
                and torch.equal(steps, ref_steps)):
            bad.append(i)
        if keep:
            kept.append((got, want))
        del got
    stale = [i for i, (got, want) in enumerate(kept) if not torch.equal(got, want)]
    return {"bad": bad, "stale": stale, "counts": counts, "eager_counts": eager_counts,
            "captures": compiled.num_captures, "events": [e.reason for e in compiled.events]}


def main() -> None:
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    init(rank, port)
    same = lambda i: 1  # noqa: E731
    # rank 0 takes a new key (n) on every call, rank 1 replays its one key
    new_keys = (lambda i: i + 1) if rank == 0 else same
    runs: dict[str, Callable[[], dict[str, Any]]] = {
        "new_keys_on_one_rank": lambda: _scenario(rank, new_keys, False),
        "new_keys_on_one_rank_warmup_0": lambda: _scenario(rank, new_keys, False, warmup=0),
        "new_keys_on_one_rank_warmup_3": lambda: _scenario(rank, new_keys, False, warmup=3),
        # rank 0 keeps its outputs: a held-outputs capture of a fn that writes a tensor besides
        # its inputs (the step counter)
        "held_outputs_on_one_rank": lambda: _scenario(rank, same, rank == 0),
        "force_recapture": lambda: _scenario(rank, same, False, force_recapture=True),
        "capture_limit_reached_on_one_rank": lambda: _scenario(rank, new_keys, False,
                                                               capture_limit=2),
        "clone_input_false": lambda: _scenario(rank, new_keys, rank == 0, clone_input=False),
        "as_strided_held_outputs_on_one_rank": lambda: _scenario(rank, same, rank == 0,
                                                                 strided=True),
        "as_strided_functional": lambda: _scenario(rank, new_keys, rank == 0, strided=True,
                                                   functional=True),
    }
    chosen = sys.argv[4].split(",") if len(sys.argv) > 4 else list(runs)
    run_scenarios({name: runs[name] for name in chosen}, out)


def init(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=20))


def run_scenarios(runs: dict[str, Callable[[], dict[str, Any]]], out: str) -> None:
    """Runs each scenario in order, writes their results to ``out`` as JSON, and leaves the
    process group. A scenario that raised is recorded as a crash and ends the run (the ranks are
    out of step: the next scenario would hang)."""
    results: dict[str, Any] = {}
    for name, run in runs.items():
        try:
            results[name] = run()
        except Exception:  # the test fails with it
            results[name] = {"crash": traceback.format_exc()[-1500:]}
            break
    with open(out, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Multi-stream code compiled with the npugraph_ex backend, probed the way inference code uses
streams: compared with eager over several calls with fresh inputs, kept outputs checked again,
captures counted (CPU logical streams)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import npugraph_runtime as ngr
import pytest
import torch
from npugraph_runtime.devices.cpu_streams import current_cpu_stream
from npugraph_runtime.ops import scope_stack

SIDE = ngr.Stream("cpu")
CALLS = 6


def kv_write_on_a_side_stream(x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    k = x * 2
    made = ngr.Event("cpu")
    made.record()
    with ngr.stream(SIDE):
        made.wait()
        cache.index_copy_(0, pos, k)  # raises for a position out of range
        written = ngr.Event("cpu")
        written.record()
    written.wait()
    return cache.sum(0) + k


def racy(x: torch.Tensor) -> torch.Tensor:
    y = x.exp()
    with ngr.stream(SIDE):
        z = y * 2  # no event: SIDE may read y before the graph's stream wrote it
        done = ngr.Event("cpu")
        done.record()
    done.wait()
    return z


@pytest.mark.parametrize("options", [{}, {"force_eager": True}], ids=["captured", "force_eager"])
def test_an_error_inside_a_stream_scope_leaves_the_thread_on_its_own_stream(
    options: dict[str, object], counter: Callable[[str], int],
) -> None:
    # the graph raised between its scope_enter and scope_exit: the side stream stayed current in
    # this thread for good, and every later op ran on it (the race check then saw one stream)
    compiled = torch.compile(kv_write_on_a_side_stream, backend="npugraph_ex", fullgraph=True,
                             options=options)
    cache, ref_cache = torch.zeros(8, 3), torch.zeros(8, 3)
    with pytest.raises(IndexError, match="out of bounds"):
        compiled(torch.ones(1, 3), torch.tensor([9]), cache)
    assert current_cpu_stream().id == 0 and scope_stack() == ()
    kept = []
    for i in range(CALLS):
        x, pos = torch.randn(1, 3), torch.tensor([i])
        got = compiled(x, pos, cache)
        want = kv_write_on_a_side_stream(x, pos, ref_cache)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(cache, ref_cache)
        kept.append((got, want))
        assert current_cpu_stream().id == 0
    for got, want in kept:
        torch.testing.assert_close(got, want)
    if not options:
        assert counter("captured_") >= 1
    with pytest.warns(ngr.CrossStreamWarning, match="no event between them"):
        torch.compile(racy, backend="npugraph_ex", fullgraph=True)(torch.randn(4))


def test_a_refused_capture_inside_a_stream_scope_leaves_the_thread_on_its_own_stream() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        with warnings.catch_warnings():
            warnings.simplefilter("error", ngr.CrossStreamWarning)
            return torch.compile(racy, backend="npugraph_ex", fullgraph=True)(y)

    with pytest.raises(ngr.CrossStreamWarning):
        fn(torch.randn(4))
    assert current_cpu_stream().id == 0 and scope_stack() == ()

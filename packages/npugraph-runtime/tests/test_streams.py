"""Logical CPU streams and events: ordering checks during capture, trivial completion outside."""

from __future__ import annotations

import warnings

import npugraph_runtime as ngr
import pytest
import torch


def _capture_two_streams(order_with_event: bool) -> tuple[object, torch.Tensor, torch.Tensor, list[warnings.WarningMessage]]:
    x = torch.randn(8)
    side = ngr.Stream("cpu")
    g = ngr.Graph("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ngr.graph(g):
            with ngr.stream(side):
                h = x.exp()
                done = ngr.Event("cpu")
                done.record()
            if order_with_event:
                done.wait()
            y = h + 1
    return g, x, y, [w for w in caught if issubclass(w.category, ngr.CrossStreamWarning)]


def test_use_on_another_stream_without_event_is_reported_once() -> None:
    g, x, y, hazards = _capture_two_streams(order_with_event=False)
    assert len(hazards) == 1
    message = str(hazards[0].message)
    assert "aten.add.Tensor" in message and "aten.exp.default" in message
    assert "cpu default stream" in message and "cpu stream" in message
    x.copy_(torch.randn(8))
    g.replay()  # replay runs in recorded order, which is a valid one
    torch.testing.assert_close(y, x.exp() + 1, rtol=0, atol=0)


def test_event_between_streams_orders_them_without_warning() -> None:
    g, x, y, hazards = _capture_two_streams(order_with_event=True)
    assert hazards == []
    x.copy_(torch.randn(8))
    g.replay()
    torch.testing.assert_close(y, x.exp() + 1, rtol=0, atol=0)


def test_wait_stream_orders_the_streams() -> None:
    x = torch.randn(4)
    side = ngr.Stream("cpu")
    g = ngr.Graph("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ngr.CrossStreamWarning)
        with ngr.graph(g):
            with ngr.stream(side):
                h = x * 3
            ngr.current_stream("cpu").wait_stream(side)
            y = h - 1
    g.replay()
    torch.testing.assert_close(y, x * 3 - 1)


def test_stream_context_switches_and_restores_the_current_stream(device: str) -> None:
    default = ngr.current_stream(device)
    s = ngr.Stream(device)
    with ngr.stream(s):
        assert ngr.current_stream(device) == s
    assert ngr.current_stream(device) == default
    assert s != default


def test_event_orders_work_between_streams(device: str) -> None:
    x = torch.randn(256, device=device)
    s = ngr.Stream(device)
    s.wait_stream(ngr.current_stream(device))  # x was made on the current stream
    done = ngr.Event(device)
    with ngr.stream(s):
        y = x * 2
        done.record()
    done.wait()  # the current stream waits for s
    z = y + 1
    done.synchronize()
    ngr.synchronize(device)
    assert done.query() and s.query()
    torch.testing.assert_close(z, x * 2 + 1)


def test_events_outside_capture_are_complete_at_once() -> None:
    s = ngr.Stream("cpu")
    e = ngr.Event("cpu")
    e.record(s)
    assert e.query() and s.query()
    e.wait()
    s.synchronize()


def test_graph_captures_on_the_given_stream() -> None:
    x = torch.randn(4)
    s = ngr.Stream("cpu")
    g = ngr.Graph("cpu")
    with ngr.graph(g, stream=s):
        assert ngr.current_stream("cpu") == s
        y = x + 2
    assert ngr.current_stream("cpu") != s
    x.copy_(torch.randn(4))
    g.replay()
    torch.testing.assert_close(y, x + 2)


def test_stream_of_unknown_device_is_a_device_error() -> None:
    with pytest.raises(ngr.DeviceError, match="'cpu', 'cuda', 'npu'"):
        ngr.Stream("xpu-like")


def test_a_label_names_no_stream_of_another_process() -> None:
    """A graph saved by one process runs in others (cache_compile): its labels must not name a
    stream the loading process made in the same place. The first stream of a new process and
    one made here never share a label, and a label of another process resolves here to a stream
    of its own, never to a live stream of this process."""
    import subprocess
    import sys

    from npugraph_runtime.ops import user_stream

    code = "import npugraph_runtime as ngr; print(ngr.Stream('cpu').label)"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, timeout=120).stdout.strip()
    here = ngr.Stream("cpu")
    assert other.startswith("stream_1_") and here.label != other
    number = int(here.label.split("_")[1])
    mine = [ngr.Stream("cpu") for _ in range(3)]  # labels stream_<number+1..3>_<this tag>
    foreign = f"stream_{number + 1}_{other.rsplit('_', 1)[1]}"
    resolved = user_stream(foreign, "cpu")
    assert all(resolved is not s for s in (here, *mine))
    assert user_stream(foreign, "cpu") is resolved  # one stream per label in this process
    assert type(here).__graph_stream_label__ == "label"  # the cache's protocol

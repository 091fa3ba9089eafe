"""torch.Stream / torch.Event (and torch.cuda's) in compiled code: dynamo's stream annotations and
``torch.ops.streams`` ops become the graph's own streams and events (npugraph_backend.torch_streams).

On the CPU, torch itself cannot record a ``torch.Event`` (eagerly either): the reference is the
same computation without the stream calls, which cannot change values."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import npugraph_runtime as ngr
import pytest
import torch
from npugraph_runtime.devices.cpu_streams import current_cpu_stream

_seen: list[int] = []
_lib = torch.library.Library("npugraph_ex_test_ts", "FRAGMENT")
_lib.define("which_stream(Tensor x) -> Tensor")


def _which_stream(x: torch.Tensor) -> torch.Tensor:
    _seen.append(current_cpu_stream().id)
    return x.clone()


_lib.impl("which_stream", _which_stream, "CompositeExplicitAutograd")
torch.library.register_fake("npugraph_ex_test_ts::which_stream", lambda x: torch.empty_like(x), lib=_lib)
_ts = torch.ops.npugraph_ex_test_ts

MAIN = torch.Stream("cpu")  # only recorded on / waited by: the graph's own stream
SIDE1 = torch.Stream("cpu")
SIDE2 = torch.Stream("cpu")


def two_branches(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The seed's scenario written with torch's device-agnostic streams and events."""
    done1, done2 = torch.Event("cpu"), torch.Event("cpu")
    SIDE1.wait_stream(MAIN)
    SIDE2.wait_stream(MAIN)
    with SIDE1:
        a = _ts.which_stream((x @ w1).relu())
    done1.record(SIDE1)
    with SIDE2:
        b = _ts.which_stream((x @ w2).sigmoid())
    done2.record(SIDE2)
    done1.wait(MAIN)
    done2.wait(MAIN)
    return _ts.which_stream(a + b)


def reference(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return (x @ w1).relu() + (x @ w2).sigmoid()


def _compile(fn: Callable[..., Any], **options: object) -> Any:
    return torch.compile(fn, backend="npugraph_ex", fullgraph=True, options=dict(options))


def _inputs() -> list[torch.Tensor]:
    return [torch.randn(8, 16), torch.randn(16, 16), torch.randn(16, 16)]


# torch 2.11's dynamo traces Stream/Event methods as method calls, which the backend refuses
METHOD_CALLS = torch.__version__ < "2.12"
needs_stream_ops = pytest.mark.skipif(
    METHOD_CALLS, reason="torch < 2.12 traces Stream/Event methods as method calls (refused)")


@pytest.mark.skipif(not METHOD_CALLS, reason="torch >= 2.12 traces torch.ops.streams ops")
def test_stream_method_calls_of_torch_before_2_12_are_refused_naming_the_node() -> None:
    with pytest.raises(Exception, match=r"wait_stream\(\) on a torch.Stream .*line \d+, in two_branches"):
        _compile(two_branches)(*_inputs())


def test_torch_event_cannot_be_recorded_on_the_cpu_eagerly() -> None:
    # why the reference below is the stream-free computation
    with pytest.raises(RuntimeError, match="doesn't support events"):
        torch.Event("cpu").record(SIDE1)


@needs_stream_ops
def test_torch_streams_two_branches_equal_eager_with_one_capture(
    counter: Callable[[str], int],
    compiles: Callable[[], int],
) -> None:
    compiled = _compile(two_branches)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ngr.CrossStreamWarning)
        for _ in range(10):
            args = _inputs()
            _seen.clear()
            torch.testing.assert_close(compiled(*args), reference(*args))
    assert counter("captured_") == 1
    assert compiles() == 1  # no recompile
    # the last replay ran each branch on its own logical stream and the join on the default one
    first, second, joined = _seen
    assert first != 0 and second != 0 and first != second and joined == 0
    assert current_cpu_stream().id == 0


@needs_stream_ops
def test_torch_stream_use_without_an_event_warns() -> None:
    def racy(x: torch.Tensor) -> torch.Tensor:
        SIDE1.wait_stream(MAIN)
        with SIDE1:
            y = x.exp()
        return y + 1  # no event: the graph's stream may read y before SIDE1 wrote it

    with pytest.warns(ngr.CrossStreamWarning, match="no event between them"):
        _compile(racy)(torch.randn(4))


def test_torch_event_without_a_stream_on_the_cpu_names_what_to_use() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        e = torch.Event("cpu")
        with SIDE1:
            y = x * 2
        e.record()
        return y

    with pytest.raises(Exception, match=r"npugraph_ex\.scope\.stream\(tag\)") as info:
        _compile(fn)(torch.ones(3))
    assert "IndexError" not in repr(info.value)


@needs_stream_ops
def test_synchronize_inside_a_compiled_function_is_refused_naming_the_node() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        with SIDE1:
            y = x * 2
        SIDE1.synchronize()
        return y

    with pytest.raises(Exception, match=r"torch.Stream.synchronize\(\) in a compiled function"):
        _compile(fn)(torch.ones(3))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@needs_stream_ops
def test_torch_cuda_streams_two_branches_equal_eager(
    counter: Callable[[str], int], compiles: Callable[[], int],
) -> None:
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def fn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        main = torch.cuda.current_stream()
        s1.wait_stream(main)
        s2.wait_stream(main)
        with torch.cuda.stream(s1):
            a = (x @ w1).relu()
        with torch.cuda.stream(s2):
            b = (x @ w2).sigmoid()
        main.wait_stream(s1)
        main.wait_stream(s2)
        return a + b

    compiled = _compile(fn)
    for _ in range(10):
        args = [t.cuda() for t in _inputs()]
        torch.testing.assert_close(compiled(*args), fn(*args))
    assert counter("captured_") == 1
    assert compiles() == 1  # no recompile


@needs_stream_ops
def test_a_loaded_multistream_graph_has_events_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import copy
    import pickle

    import torch._functorch.config as functorch_config
    from npugraph_backend.serialization import SerializableCompiledGraph, observe_compiled

    def fn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        done = torch.Event("cpu")
        SIDE1.wait_stream(MAIN)
        with SIDE1:
            a = (x @ w1).relu()
        done.record(SIDE1)
        b = (x @ w2).sigmoid()  # the saved graph's own ops only (a test op cannot be pickled)
        done.wait(MAIN)
        return a + b

    # an empty AOTAutograd cache: the compile is a miss, never an earlier run's hit
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch_cache"))
    seen: list[Any] = []
    compiled = _compile(fn)
    with functorch_config.patch(bundled_autograd_cache=True), observe_compiled(seen.append):
        compiled(*_inputs())
    [graph] = seen
    on_disk = copy.copy(SerializableCompiledGraph(graph))
    on_disk.prepare_for_serialization()
    loaded = pickle.loads(pickle.dumps(on_disk))
    loaded.post_compile([], None, {})

    def tags(gm: torch.fx.GraphModule) -> set[str]:
        return {n.args[0] for n in gm.graph.nodes
                if n.target is torch.ops.npugraph_ex.event_record.default}

    assert tags(graph.gm) and not tags(graph.gm) & tags(loaded.compiled.gm)
    assert all(t.startswith(f"{loaded.compiled.name}_") for t in tags(loaded.compiled.gm))
    for _ in range(5):
        args = _inputs()
        torch.testing.assert_close(loaded.compiled(args), [reference(*args)])


class _FakeGpuEvent:
    """Stands in for a GPU torch.Event (no GPU here): records when it is waited on."""

    device = torch.device("cuda")

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def wait(self) -> None:
        self.log.append("wait")


def test_a_wait_on_work_from_before_the_graph_is_issued_before_every_call() -> None:
    from npugraph_backend.torch_streams import ExternalWait, with_external_waits

    log: list[str] = []

    def compiled(args: list[torch.Tensor]) -> list[torch.Tensor]:
        log.append("graph")
        return [args[0] + 1]

    compiled._boxed_call = True  # type: ignore[attr-defined]
    call = with_external_waits(compiled, [ExternalWait(_FakeGpuEvent(log))])
    assert call._boxed_call  # dynamo still passes one list
    for i in range(3):
        torch.testing.assert_close(call([torch.full((2,), float(i))]), [torch.full((2,), i + 1.0)])
    assert log == ["wait", "graph"] * 3
    assert with_external_waits(compiled, []) is compiled


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_compiled_wait_on_an_event_recorded_before_the_call_orders_the_replay(
    counter: Callable[[str], int],
) -> None:
    side = torch.cuda.Stream()
    done = torch.cuda.Event()

    def fn(x: torch.Tensor) -> torch.Tensor:
        done.wait(torch.cuda.current_stream())
        return x * 2

    compiled = _compile(fn)
    x = torch.zeros(1 << 20, device="cuda")
    for i in range(6):
        src = torch.full_like(x, float(i + 1))
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)  # the write lands long after the call is issued
            x.copy_(src)
        done.record(side)
        torch.testing.assert_close(compiled(x), src * 2)
    assert counter("captured_") == 1


def test_a_compiled_wait_on_an_accelerator_event_never_recorded_in_the_graph_becomes_an_external_wait(
    counter: Callable[[str], int], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The event is a CPU torch.Event to dynamo; to the rewrite it is a GPU event we do not have
    # (the fake above), as it would be on a GPU machine.
    from npugraph_backend import torch_streams

    before = torch.Event("cpu")
    log: list[str] = []
    fake = _FakeGpuEvent(log)
    lookup = torch_streams._compat.external_object
    monkeypatch.setattr(torch_streams._compat, "external_object",
                        lambda i: fake if isinstance(lookup(i), torch.Event) else lookup(i))

    def fn(x: torch.Tensor) -> torch.Tensor:
        before.wait(MAIN)
        return x * 2

    compiled = _compile(fn)
    for i in range(5):
        x = torch.randn(8)
        torch.testing.assert_close(compiled(x), x * 2)
        assert log == ["wait"] * (i + 1)
    assert counter("captured_") == 1


_LABELS_OF_A_NEW_PROCESS = """
import torch
from npugraph_backend.torch_streams import rewrite_torch_streams
from npugraph_runtime.scope_keys import USER_STREAM_LABEL

side = torch.Stream("cpu")
labels = []

def keep_labels(gm, example_inputs):
    rewrite_torch_streams(gm)
    labels.extend(n.args[1][0] for n in gm.graph.nodes
                  if n.target is torch.ops.npugraph_ex.scope_enter.default
                  and n.args[0] == [USER_STREAM_LABEL])
    return gm.forward

def fn(x):
    with side:
        y = x * 3
    return y + 1

torch.compile(fn, backend=keep_labels, fullgraph=True)(torch.randn(4))
print(" ".join(labels))
"""


@needs_stream_ops
def test_the_side_stream_labels_of_two_processes_graphs_differ() -> None:
    # a graph saved by one process is lowered again by the one that loads it (cache_compile),
    # where a label of the first process's graph must not name a stream of the second's graphs
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def labels() -> set[str]:
        done = subprocess.run([sys.executable, "-c", _LABELS_OF_A_NEW_PROCESS], env=env,
                              check=True, timeout=240, capture_output=True, text=True)
        return set(done.stdout.split())

    first, second = labels(), labels()
    assert first and second and not first & second, (first, second)

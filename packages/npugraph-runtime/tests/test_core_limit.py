"""limit_core_num on CPU (intra-op threads) and inside torch.compile(fullgraph=True)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Iterator

import npugraph_runtime as ngr
import pytest
import torch
from npugraph_runtime import core_limit
from npugraph_runtime.errors import DeviceError, PolicyError
from torch._dynamo.backends.common import aot_autograd

CPU_MAX = os.cpu_count() or 1


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_cpu_threads_are_limited_inside_and_restored_after() -> None:
    torch.set_num_threads(CPU_MAX)
    with ngr.limit_core_num(1, 0, device="cpu"):
        assert torch.get_num_threads() == 1
        assert ngr.current_core_limit() == ("cpu", 1, 0)
    assert torch.get_num_threads() == CPU_MAX
    assert ngr.current_core_limit() is None


def test_threads_are_restored_when_the_scope_raises() -> None:
    torch.set_num_threads(CPU_MAX)
    with pytest.raises(KeyError), ngr.limit_core_num(1, 0, device="cpu"):
        raise KeyError("inside")
    assert torch.get_num_threads() == CPU_MAX


def test_nested_scopes_restore_the_outer_limit() -> None:
    torch.set_num_threads(CPU_MAX)
    with ngr.limit_core_num(CPU_MAX, 0, device="cpu"):
        with ngr.limit_core_num(1, 0, device="cpu"):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == CPU_MAX
        assert ngr.current_core_limit() == ("cpu", CPU_MAX, 0)


def test_one_object_can_be_entered_twice() -> None:
    torch.set_num_threads(CPU_MAX)
    scope = ngr.limit_core_num(1, 0, device="cpu")
    with scope, scope:
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == CPU_MAX


def test_results_inside_the_scope_equal_eager() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    expected = torch.nn.functional.gelu(a @ b)
    with ngr.limit_core_num(1, 0, device="cpu"):
        got = torch.nn.functional.gelu(a @ b)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    ("aicore", "vectorcore", "name", "lowest"),
    [
        (0, 0, "op_aicore_num", 1),
        (-3, 0, "op_aicore_num", 1),
        (CPU_MAX + 1, 0, "op_aicore_num", 1),
        (True, 0, "op_aicore_num", 1),
        (1.0, 0, "op_aicore_num", 1),
        ("2", 0, "op_aicore_num", 1),
        (1, -1, "op_vectorcore_num", 0),
        (1, CPU_MAX + 1, "op_vectorcore_num", 0),
        (1, False, "op_vectorcore_num", 0),
        (1, None, "op_vectorcore_num", 0),
    ],
)
def test_values_out_of_range_name_the_argument_and_the_maximum(
    aicore: object, vectorcore: object, name: str, lowest: int
) -> None:
    with pytest.raises(PolicyError) as info:
        ngr.limit_core_num(aicore, vectorcore, device="cpu")  # type: ignore[arg-type]
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert message.startswith(f"{name}={aicore if name == 'op_aicore_num' else vectorcore!r}")
    assert f"from {lowest} to {CPU_MAX}" in message


def test_the_cpu_maximum_is_the_cpu_count() -> None:
    assert ngr.max_core_num("cpu") == (CPU_MAX, CPU_MAX)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vector cores do not apply to CPUs
        with ngr.limit_core_num(CPU_MAX, CPU_MAX, device="cpu"):
            assert torch.get_num_threads() == CPU_MAX


def test_the_default_device_is_the_cpu_without_an_accelerator() -> None:
    if torch.cuda.is_available() or hasattr(torch, "npu"):
        pytest.skip("an accelerator is the default here")
    with ngr.limit_core_num(1, 0):
        assert torch.get_num_threads() == 1
        assert ngr.current_core_limit() == ("cpu", 1, 0)


def test_an_unsupported_device_is_refused() -> None:
    with pytest.raises(DeviceError, match="'meta'"):
        ngr.limit_core_num(1, 1, device="meta")


def test_vector_cores_on_cpu_are_reported_once() -> None:
    core_limit._warned.discard("cpu-vector")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ngr.limit_core_num(1, 1, device="cpu"):
            pass
        with ngr.limit_core_num(1, 2, device="cpu"):
            pass
    messages = [str(w.message) for w in caught if "op_vectorcore_num" in str(w.message)]
    assert len(messages) == 1 and "does not apply" in messages[0]


def _mlp_with_scope(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ w1)
    with ngr.limit_core_num(1, 0, device="cpu"):
        h = torch.tanh(h @ w2)
    return h.sum(dim=-1)


def test_compiled_fullgraph_keeps_the_scope_ops_in_order() -> None:
    graphs: list[torch.fx.GraphModule] = []

    def fw(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    args = (torch.randn(8, 32), torch.randn(32, 64), torch.randn(64, 16))
    compiled = torch.compile(_mlp_with_scope, backend=aot_autograd(fw_compiler=fw), fullgraph=True)
    torch.testing.assert_close(compiled(*args), _mlp_with_scope(*args))

    nodes = [n for n in graphs[0].graph.nodes if n.op == "call_function"]
    targets = [n.target for n in nodes]
    enter = targets.index(torch.ops.npugraph_ex.scope_enter.default)
    leave = targets.index(torch.ops.npugraph_ex.scope_exit.default)
    assert nodes[enter].args == (["_op_aicore_num", "_op_vectorcore_num"], ["1", "0"])
    mms = [i for i, t in enumerate(targets) if t == torch.ops.aten.mm.default]
    tanh = targets.index(torch.ops.aten.tanh.default)
    assert mms[0] < enter < mms[1] < tanh < leave  # the second matmul and tanh are inside


def test_compiled_with_aot_eager_equals_eager_and_leaves_threads_alone() -> None:
    torch.manual_seed(1)
    args = (torch.randn(4, 32), torch.randn(32, 64), torch.randn(64, 16))
    before = torch.get_num_threads()
    compiled = torch.compile(_mlp_with_scope, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*args), _mlp_with_scope(*args))
    assert torch.get_num_threads() == before
    assert ngr.current_scope() == {}


def test_compiled_values_out_of_range_are_refused_with_the_argument_named() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        with ngr.limit_core_num(CPU_MAX + 1, 0, device="cpu"):
            return x + 1

    with pytest.raises(Exception, match="op_aicore_num"):
        torch.compile(fn, backend="aot_eager", fullgraph=True)(torch.ones(2))



# torch_npu stands in for hardware this machine lacks: a fake ``torch.npu`` records the stream
# limits the scope sets. It runs in a subprocess because naming the privateuse1 backend "npu"
# (needed for torch.device("npu")) cannot be undone in a process.
_NPU_SCRIPT = """
import torch
torch.utils.rename_privateuse1_backend("npu")

class FakeNpu:
    def __init__(self):
        self.limits = {"cube_core_num": 24, "vector_core_num": 48}
        self.calls = []
    def is_available(self): return True
    def current_device(self): return 0
    def current_stream(self, device=None): return "stream0"
    def get_stream_limit(self, stream): return dict(self.limits)
    def set_stream_limit(self, stream, cube, vector):
        self.calls.append((stream, cube, vector))
        self.limits = {"cube_core_num": cube, "vector_core_num": vector}
    def get_device_limit(self, index): return {"cube_core_num": 24, "vector_core_num": 48}

npu = torch.npu = FakeNpu()
import npugraph_runtime as ngr
from npugraph_runtime.core_limit import default_device
assert default_device() == torch.device("npu", 0)
assert ngr.max_core_num("npu") == (24, 48)
with ngr.limit_core_num(8, 16):
    assert npu.limits == {"cube_core_num": 8, "vector_core_num": 16}
    with ngr.limit_core_num(4, 4):
        assert ngr.current_core_limit() == ("npu", 4, 4)
    assert npu.limits == {"cube_core_num": 8, "vector_core_num": 16}
assert npu.calls == [("stream0", 8, 16), ("stream0", 4, 4), ("stream0", 8, 16),
                     ("stream0", 24, 48)], npu.calls
for bad in (49, 0):
    try:
        ngr.limit_core_num(8, bad)
    except ValueError as e:
        assert str(e).startswith(f"op_vectorcore_num={bad} ") and "from 1 to 48" in str(e), e
    else:
        raise AssertionError(bad)
print("ok")
"""


def test_npu_stream_limits_are_set_and_restored() -> None:
    done = subprocess.run([sys.executable, "-c", _NPU_SCRIPT], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


_seen_threads: list[int] = []
_threads_lib = torch.library.Library("npugraph_ex_test_cl", "FRAGMENT")
_threads_lib.define("threads(Tensor x) -> Tensor")


def _read_threads(x: torch.Tensor) -> torch.Tensor:
    _seen_threads.append(torch.get_num_threads())
    return x + torch.get_num_threads()


_threads_lib.impl("threads", _read_threads, "CompositeExplicitAutograd")
torch.library.register_fake("npugraph_ex_test_cl::threads", lambda x: torch.empty_like(x),
                            lib=_threads_lib)


def _threads_times_two(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.npugraph_ex_test_cl.threads(x) * 2


@pytest.mark.skipif(CPU_MAX < 2, reason="needs 2 CPU cores to tell two limits apart")
def test_one_cpu_capture_replays_under_each_limit_around_the_call() -> None:
    torch.set_num_threads(2)
    fn = ngr.make_graphed_callable(_threads_times_two, (torch.zeros(3),), name="cpu_limits")
    for limit in (2, 1, 2, 1, 2):
        x = torch.randn(3)
        _seen_threads.clear()
        with ngr.limit_core_num(limit, 0, device="cpu"):
            got = fn(x).clone()
            want = _threads_times_two(x)  # eager under the same limit
        torch.testing.assert_close(got, want)
        # the replay (and, on the first call, warm-up and capture) ran the op with the limit in
        # force, as eager did
        assert set(_seen_threads) == {limit} and len(_seen_threads) >= 2
    assert [e.reason for e in fn.events] == ["new_key"]
    assert core_limit.capture_core_limit() is None


_NPU_KEY_SCRIPT = _NPU_SCRIPT.split("npu = torch.npu = FakeNpu()")[0] + """
npu = torch.npu = FakeNpu()
import npugraph_runtime as ngr
from npugraph_runtime.core_limit import capture_core_limit
fn = ngr.make_graphed_callable(lambda x: x * 2, (torch.zeros(3),), name="npu_limits")
for limit in (None, 4, 4, 8, None):
    x = torch.randn(3)
    if limit is None:
        got = fn(x).clone()
    else:
        with ngr.limit_core_num(limit, limit), ngr.limit_core_num(1, 0, device="cpu"):
            assert capture_core_limit() == ("npu", limit, limit)  # the CPU limit is not keyed
            got = fn(x).clone()
    assert torch.equal(got, x * 2)
reasons = [e.reason for e in fn.events]
# a capture under another limit replaces the key's capture (manager.py): back to no limit is one more
assert reasons == ["new_key"] + ["core_limit_change"] * 3, reasons
print("ok")
"""


def test_an_npu_stream_limit_keys_its_own_capture() -> None:
    # a fake torch.npu (no NPU here): the stream limit a device graph would capture under
    done = subprocess.run([sys.executable, "-c", _NPU_KEY_SCRIPT], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


_NPU_SIDE_STREAM_SCRIPT = """
import torch
torch.utils.rename_privateuse1_backend("npu")

class FakeStream:
    def __init__(self, name):
        self.name, self.device = name, torch.device("npu", 0)
    def __repr__(self): return self.name

class FakeNpu:
    def __init__(self):
        self.current = FakeStream("main")
        self.limits = {}
        self.calls = []
    def is_available(self): return True
    def current_device(self): return 0
    def device_count(self): return 1
    def current_stream(self, device=None): return self.current
    def set_stream(self, stream): self.current = stream
    def get_stream_limit(self, stream):
        return dict(self.limits.get(stream.name, {"cube_core_num": 24, "vector_core_num": 48}))
    def set_stream_limit(self, stream, cube, vector):
        self.calls.append((stream.name, cube, vector))
        self.limits[stream.name] = {"cube_core_num": cube, "vector_core_num": vector}
    def get_device_limit(self, index): return {"cube_core_num": 24, "vector_core_num": 48}

npu = torch.npu = FakeNpu()
import npugraph_runtime as ngr
from npugraph_runtime import devices, ops
from npugraph_runtime.devices.accelerator import AcceleratorBackend
devices._BACKENDS["npu"] = AcceleratorBackend("npu", module=npu)
side = FakeStream("side")
ops.register_user_stream("side", side)
enter, leave = torch.ops.npugraph_ex.scope_enter, torch.ops.npugraph_ex.scope_exit
# what a lowered `with limit_core_num(8, 16), stream(side):` runs
enter(["_op_aicore_num", "_op_vectorcore_num", "_device"], ["8", "16", "npu:0"])
enter(["_user_stream_label", "_device"], ["side", "npu:0"])
assert npu.current is side
assert npu.limits["side"] == {"cube_core_num": 8, "vector_core_num": 16}, npu.limits
leave()
assert npu.current.name == "main"
assert npu.limits["side"] == {"cube_core_num": 24, "vector_core_num": 48}, npu.limits
leave()
assert npu.calls == [("main", 8, 16), ("side", 8, 16), ("side", 24, 48), ("main", 24, 48)], npu.calls
print("ok")
"""


def test_an_npu_limit_is_inherited_by_a_side_stream_entered_inside_it() -> None:
    # a fake torch.npu (no NPU here): an NPU limit is per stream, so a side stream entered under
    # a limit gets it too, and its own limit back after
    done = subprocess.run([sys.executable, "-c", _NPU_SIDE_STREAM_SCRIPT], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr

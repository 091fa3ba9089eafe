"""On an Ascend machine torch is a CPU build, which lacks torch's batched address check, and
torch_npu brings its own in ``torch_npu._C``. torch_npu cannot be imported here (no Ascend
hardware or CANN), so a FAKE ``torch_npu`` module stands in for it: its ``_C`` has a Python
function with the documented signature, which counts its calls. The capture manager must pick
it up and still catch a re-bound static input through it."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import npugraph_runtime as ngr
import pytest
import torch
from npugraph_runtime import _compat, bindings
from torch._dynamo.utils import counters

calls = [0]


def _fake_equal(tensors: list[object], data_ptrs: list[int | None], indices: list[int]) -> bool:
    calls[0] += 1
    return all(tensors[i].data_ptr() == data_ptrs[i] for i in indices)  # type: ignore[attr-defined]


@pytest.fixture
def fake_torch_npu() -> Iterator[None]:
    if hasattr(torch._C, "_tensors_data_ptrs_at_indices_equal"):
        pytest.skip("this torch has its own batched check (a CUDA build)")
    fake = types.ModuleType("torch_npu")
    fake._C = types.SimpleNamespace(_tensors_data_ptrs_at_indices_equal=_fake_equal)  # type: ignore[attr-defined]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "torch_npu", fake)
        bindings.checked_ptrs_equal.cache_clear()
        yield
    bindings.checked_ptrs_equal.cache_clear()


def test_torch_npus_batched_check_is_used_and_catches_a_rebound_weight(fake_torch_npu: None) -> None:
    assert _compat.data_ptrs_at_indices_equal() is _fake_equal
    counters.clear()
    w = torch.randn(8, 8)
    g = ngr.make_graphed_callable(lambda x, w: x @ w, [torch.randn(2, 8), w], static_argnums=(1,),
                                  name="npu_check")
    with torch.no_grad():
        for step in range(6):
            if step == 3:
                w.data = torch.randn(8, 8)  # a .data swap: the same object, another address
            x = torch.randn(2, 8)
            calls[0] = 0
            torch.testing.assert_close(g(x, w), x @ w)
            assert calls[0] >= 1 or step == 0  # a replay checked the addresses through it
    seen = counters["npugraph_ex"]
    assert seen["captured_npu_check"] == 2
    assert seen["recapture_due_to_static_input_change_npu_check"] == 1

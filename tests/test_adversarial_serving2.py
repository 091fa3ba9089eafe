"""The serving path (npugraph_ex.inference.cache_compile) on methods that update the Python state
they read: every call's output and the state afterwards equal eager's, cold and warm, and a
capture is counted."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from npugraph_cache.secret import KEY_ENV
from torch._dynamo.utils import counters

from npugraph_ex.inference import cache_compile

CALLS = 6
STEP = 0  # a module global a served method increments


@pytest.fixture(autouse=True)
def own_cache_key(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, str(tmp_path_factory.mktemp("key") / "cache.key"))
        yield


class Stateful(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.calls = 0
        self.scale = 1.0
        self.hist: list[torch.Tensor] = []

    def count(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.proj(x) * self.calls

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        self.scale = self.scale * 0.5
        return self.proj(x) * self.scale

    def remember(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        self.hist.append(y)
        return y * len(self.hist)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        global STEP
        STEP += 1
        return self.proj(x) * STEP


def _state(model: Stateful) -> tuple[int, float, int, list[torch.Tensor]]:
    return model.calls, model.scale, STEP, [h.clone() for h in model.hist]


@pytest.mark.parametrize("start", ["cold", "warm"])
@pytest.mark.parametrize("method", ["count", "decay", "remember", "step"])
def test_a_method_updating_state_it_reads(tmp_path: Path, method: str, start: str) -> None:
    """An entry replays the values its trace read: the attribute guards are not re-checked on a
    call, and the loaded function's globals are a copy. ``self.calls += 1`` returned the first
    call's result on every call and left calls at 1; ``self.hist.append(y)`` left one item in
    the list (the entry replays the traced list); ``global STEP; STEP += 1`` never changed the
    user's STEP."""
    global STEP
    counters.clear()
    torch._dynamo.reset()  # the methods' code objects are shared by the cases
    torch.manual_seed(0)
    STEP = 0
    if start == "warm":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.no_grad():
                cache_compile(getattr(Stateful(), method), dynamic=False, cache_dir=tmp_path)(
                    torch.randn(2, 8))
    STEP = 0
    model = Stateful().eval()
    eager = copy.deepcopy(model)
    fn = cache_compile(getattr(model, method), dynamic=False, cache_dir=tmp_path)
    with pytest.warns(UserWarning, match="would repeat the value it was traced with"):
        for _ in range(CALLS):
            x = torch.randn(2, 8)
            before = STEP
            with torch.no_grad():
                got = fn(x)
            ours = _state(model)
            STEP = before  # eager's turn from the same global
            with torch.no_grad():
                want = getattr(eager, method)(x)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(ours, _state(eager))
    assert sum(v for k, v in counters["npugraph_ex"].items() if k.startswith("captured_")) >= 1

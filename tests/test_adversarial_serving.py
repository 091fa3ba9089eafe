"""The serving path (npugraph_ex.inference.cache_compile) on methods users write: each call equal
to eager, a capture counted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from npugraph_cache.secret import KEY_ENV

from npugraph_ex.inference import cache_compile


@pytest.fixture(autouse=True)
def own_cache_key(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, str(tmp_path_factory.mktemp("key") / "cache.key"))
        yield


class KeywordOnly(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def step(self, x: torch.Tensor, *, gain: float = 2.0) -> torch.Tensor:
        return torch.relu(self.proj(x)) * gain


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_method_with_a_keyword_only_default(tmp_path: Path, start: str) -> None:
    """A method with a keyword-only default is served over several calls, equal to eager (the
    since removed direct plan's probe once re-made dynamo's function without its keyword-only
    defaults: the entry's second call raised "missing 1 required keyword-only argument")."""
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    model = KeywordOnly().eval()
    if start == "warm":
        cache_compile(model.step, dynamic=False, cache_dir=tmp_path)(torch.randn(4, 16))
    fn = cache_compile(model.step, dynamic=False, cache_dir=tmp_path)
    for _ in range(6):
        x = torch.randn(4, 16)
        with torch.no_grad():
            want = model.step(x)
        torch.testing.assert_close(fn(x), want)
    assert sum(v for k, v in counters["npugraph_ex"].items() if k.startswith("captured_")) >= 1

"""Patterns of real inference code that must not make every call compile or capture again:
each asserts, with counters, that the later calls reuse what the first ones made, and compares
every output with eager."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from npugraph_cache import _compat
from npugraph_cache.secret import KEY_ENV

from npugraph_ex.inference import cache_compile

CALLS = 6


@pytest.fixture(autouse=True)
def own_cache_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from torch._dynamo.utils import counters

    monkeypatch.setenv(KEY_ENV, str(tmp_path / "cache.key"))
    torch.compiler.reset()
    counters.clear()
    yield
    torch.compiler.reset()
    counters.clear()


def _counts(group: str, prefix: str) -> int:
    from torch._dynamo.utils import counters

    return sum(v for k, v in counters[group].items() if k.startswith(prefix))


class Sampler(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def scaled(self, x: torch.Tensor, temperature: float) -> torch.Tensor:
        return torch.softmax(self.proj(x) / temperature, -1)

    def exp_scaled(self, x: torch.Tensor, temperature: float) -> torch.Tensor:
        return self.proj(x) * math.exp(temperature)  # a host computation: the float is a constant


no_aot_compile = pytest.mark.skipif(not _compat.has_aot_compile(),
                                    reason=f"torch {torch.__version__}: no aot_compile")


@no_aot_compile
def test_serving_path_temperature_new_on_every_call_compiles_and_captures_once(
    tmp_path: Path,
) -> None:
    """A request's temperature (a Python float) differs on every call: it is a graph input, so
    the serving path compiles one entry and replays one capture (before: a compile, a disk
    entry and a capture on every call, ~900x aot_eager)."""
    torch.manual_seed(0)
    model = Sampler().eval()
    fn = cache_compile(model.scaled, cache_dir=tmp_path)
    for n in range(CALLS):
        x, t = torch.randn(4, 16), 0.5 + 0.013 * n
        with torch.no_grad():
            expected = model.scaled(x, t)
        torch.testing.assert_close(fn(x, t), expected, rtol=1e-5, atol=1e-6)
    assert _counts("npugraph_ex_cache", "compiled") == 1
    assert _counts("npugraph_ex", "captured_") == 1
    assert _counts("npugraph_ex", "capture_due_to_") + _counts("npugraph_ex", "recapture_") == 1


@no_aot_compile
def test_serving_path_float_the_code_must_specialise_gets_an_entry_per_value(
    tmp_path: Path,
) -> None:
    """math.exp(temperature) cannot stay symbolic: each value gets its own entry, as before, and
    a value seen again reuses its entry; never another value's constant."""
    torch.manual_seed(0)
    model = Sampler().eval()
    fn = cache_compile(model.exp_scaled, cache_dir=tmp_path)
    temperatures = [0.5, 0.7, 0.5, 0.9, 0.7, 0.5]
    for t in temperatures:
        x = torch.randn(4, 16)
        with torch.no_grad():
            expected = model.exp_scaled(x, t)
        torch.testing.assert_close(fn(x, t), expected, rtol=1e-5, atol=1e-6)
    assert _counts("npugraph_ex_cache", "compiled") == len(set(temperatures))
    assert _counts("npugraph_ex", "captured_") == len(set(temperatures))


@no_aot_compile
def test_serving_path_symbolic_float_entry_loads_in_a_new_cache_compile(tmp_path: Path) -> None:
    """The entry made for a symbolic float is keyed by the type, not the value: another
    cache_compile of the method (a restart) loads it for any temperature."""
    torch.manual_seed(0)
    model = Sampler().eval()
    cache_compile(model.scaled, cache_dir=tmp_path)(torch.randn(4, 16), 0.3)
    torch.compiler.reset()
    fn = cache_compile(model.scaled, cache_dir=tmp_path)
    for n in range(CALLS):
        x, t = torch.randn(4, 16), 1.5 - 0.1 * n
        with torch.no_grad():
            expected = model.scaled(x, t)
        torch.testing.assert_close(fn(x, t), expected, rtol=1e-5, atol=1e-6)
    assert _counts("npugraph_ex_cache", "compiled") == 1


class Branches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def step(self, x: torch.Tensor, temperature: float) -> torch.Tensor:
        y = self.proj(x)
        return y * 2.0 if temperature > 0.5 else y / temperature  # a branch on the float


@no_aot_compile
def test_serving_path_branch_on_a_float_argument_follows_each_value(tmp_path: Path) -> None:
    """A float the traced code branches on: every call gets its branch's result."""
    torch.manual_seed(0)
    model = Branches().eval()
    fn = cache_compile(model.step, cache_dir=tmp_path)
    for t in [0.3, 0.9, 0.4, 0.7, 0.2, 1.1]:
        x = torch.randn(4, 16)
        with torch.no_grad():
            expected = model.step(x, t)
        torch.testing.assert_close(fn(x, t), expected, rtol=1e-5, atol=1e-6)
    assert _counts("npugraph_ex", "captured_") >= 2

"""Shared fixtures of the runtime tests: deterministic seeds and tiny models."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(
    params=[
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
            ],
        ),
    ]
)
def device(request: pytest.FixtureRequest) -> str:
    """The behaviours every device graph shares run on the CPU and, where present, on CUDA."""
    return str(request.param)


def mlp(sizes: tuple[int, ...] = (32, 64, 64, 16)) -> torch.nn.Module:
    """A small ReLU MLP in eval mode."""
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]).eval()


@pytest.fixture
def small_mlp() -> torch.nn.Module:
    return mlp()


@pytest.fixture
def make_mlp() -> Callable[..., torch.nn.Module]:
    """``make_mlp(sizes)``: a fresh MLP (tests import no helpers under --import-mode=importlib)."""
    return mlp


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _flat(v)]
    return [value]


def _assert_same(got: Any, want: Any) -> None:
    got_l, want_l = _flat(got), _flat(want)
    assert len(got_l) == len(want_l)
    for g, w in zip(got_l, want_l, strict=True):
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor) and g.dtype == w.dtype and g.shape == w.shape
            assert torch.equal(g, w), (g, w)
        else:
            assert g == w


@pytest.fixture
def assert_same() -> Callable[[Any, Any], None]:
    """``assert_same(got, want)``: the same nesting, dtypes and shapes, and bitwise the same
    values (for a replay against eager running the same ops on the same data)."""
    return _assert_same

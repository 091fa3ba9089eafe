"""Shared fixtures of the runtime tests: deterministic seeds and tiny models."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def mlp(sizes: tuple[int, ...] = (32, 64, 64, 16)) -> torch.nn.Module:
    """A small ReLU MLP in eval mode."""
    layers: list[torch.nn.Module] = []
    for a, b in zip(sizes, sizes[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]).eval()


@pytest.fixture
def small_mlp() -> torch.nn.Module:
    return mlp()

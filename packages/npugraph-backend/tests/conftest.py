"""Every test starts with a fresh Dynamo cache and empty npugraph_ex counters."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from npugraph_backend import _compat


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    _compat.dynamo_reset()
    _compat.dynamo_counters().clear()
    torch.manual_seed(0)
    yield
    _compat.dynamo_reset()


def _counter(prefix: str) -> int:
    return sum(v for k, v in _compat.counters().items() if k.startswith(prefix))


@pytest.fixture
def counter() -> Callable[[str], int]:
    """The sum of the npugraph_ex counters whose name starts with a prefix."""
    return _counter


def _compiles() -> int:
    return int(_compat.dynamo_counters()["stats"]["unique_graphs"])


@pytest.fixture
def compiles() -> Callable[[], int]:
    """Graphs dynamo compiled: a recompile is one more (torch 2.13 leaves counters["recompiles"]
    empty, so a test reading it would pass whatever happened)."""
    return _compiles

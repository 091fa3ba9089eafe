"""A method that reads tensors and modules which are not its module's parameters, buffers or
submodules: in a dict or list attribute, through a plain object (``self.cfg.table``), in a
closure cell, in a global tensor, or a module held by a global or a closure cell (torch refuses
to save an ``nn.Module`` that is not external data: the cache makes each such module external
data, bound at load to what the name or the cell holds then). Each is saved, loaded by a new cache_compile on the
same folder (a restarted process), and equal to eager cold and warm over 3 calls."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from npugraph_cache import CacheWarning, _compat, cache_compile
from torch._dynamo.utils import counters

pytestmark = pytest.mark.skipif(not _compat.has_aot_compile(),
                                reason=f"torch {torch.__version__}: no disk cache (no aot_compile)")

torch.manual_seed(0)
GLOBAL_TABLE = torch.randn(8)
GLOBAL_PROJ = torch.nn.Linear(8, 8)


class Cfg:
    def __init__(self) -> None:
        self.table = torch.randn(8)
        self.proj = torch.nn.Linear(8, 8)


def _closure_scale() -> Callable[[torch.Tensor], torch.Tensor]:
    scale = torch.randn(8)
    return lambda h: h * scale


class Outside(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.tables = {"w": torch.randn(8)}
        self.rows = [torch.randn(8)]
        self.cfg = Cfg()
        self.unregistered = {"p": torch.nn.Linear(8, 8)}  # a plain dict: not a submodule
        self.scale = _closure_scale()

    def in_a_dict(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.tables["w"] + self.rows[0]

    def through_an_object(self, x: torch.Tensor) -> torch.Tensor:
        return self.cfg.proj(self.lin(x)) * self.cfg.table

    def unregistered_module(self, x: torch.Tensor) -> torch.Tensor:
        return self.unregistered["p"](x) - self.lin(x)

    def in_a_closure(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.lin(x))

    def global_tensor(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * GLOBAL_TABLE

    def global_module(self, x: torch.Tensor) -> torch.Tensor:
        return GLOBAL_PROJ(x) - self.lin(x)


def _closing_over_a_module() -> torch.nn.Module:
    """A method of a class defined in a function, closing over a module of that function."""
    proj = torch.nn.Linear(8, 8)

    class Closing(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def step(self, x: torch.Tensor) -> torch.Tensor:
            return proj(x) - self.lin(x)

    return Closing().eval()


@pytest.fixture(autouse=True)
def fresh_counters() -> Iterator[None]:
    counters.clear()
    yield
    counters.clear()


@pytest.mark.parametrize("method", ["in_a_dict", "through_an_object", "unregistered_module",
                                    "in_a_closure", "global_tensor", "global_module"])
def test_saved_loaded_and_equal_to_eager(tmp_path: Path, method: str) -> None:
    model = Outside().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)  # "cannot be saved" included
        for _ in range(2):  # cold, then a new cache_compile loading the entry
            fn = cache_compile(getattr(model, method), cache_dir=tmp_path)
            for i in range(3):
                x = torch.randn(4, 8)
                with torch.no_grad():
                    torch.testing.assert_close(fn(x), getattr(model, method)(x), msg=f"call {i}")
    assert counters["npugraph_ex_cache"]["compiled"] == 1
    assert counters["npugraph_ex_cache"]["loaded"] == 1


def test_a_global_module_replaced_after_the_save_is_the_one_used(tmp_path: Path) -> None:
    """The loaded entry runs the module the global holds now (bound at load), never the one it
    was compiled with."""
    global GLOBAL_PROJ
    model = Outside().eval()
    fn = cache_compile(model.global_module, cache_dir=tmp_path)
    fn(torch.randn(4, 8))
    old = GLOBAL_PROJ
    try:
        GLOBAL_PROJ = torch.nn.Linear(8, 8)
        for _ in range(2):  # the running process, then a new cache_compile loading
            fn = cache_compile(model.global_module, cache_dir=tmp_path)
            for _ in range(3):
                x = torch.randn(4, 8)
                with torch.no_grad():
                    torch.testing.assert_close(fn(x), model.global_module(x))
    finally:
        GLOBAL_PROJ = old


def test_a_module_in_a_closure_cell_is_saved_and_bound_at_load(tmp_path: Path) -> None:
    model = _closing_over_a_module()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        for _ in range(2):  # cold, then a new cache_compile loading the entry
            fn = cache_compile(model.step, cache_dir=tmp_path)
            for _ in range(3):
                x = torch.randn(4, 8)
                with torch.no_grad():
                    torch.testing.assert_close(fn(x), model.step(x))
    assert counters["npugraph_ex_cache"]["compiled"] == 1
    assert counters["npugraph_ex_cache"]["loaded"] == 1
    cell = type(model).step.__closure__[0]
    cell.cell_contents = torch.nn.Linear(8, 8)  # another module in the cell: it is the one used
    for _ in range(2):
        fn = cache_compile(model.step, cache_dir=tmp_path)
        for _ in range(3):
            x = torch.randn(4, 8)
            with torch.no_grad():
                torch.testing.assert_close(fn(x), model.step(x))

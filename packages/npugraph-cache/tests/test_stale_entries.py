"""A restart must never be served an entry made for another model: values the traced code read
that are not plain constants (a C function, a class, an enum member) and the parameters' layouts
when the compiler drops torch's parameter guards. Each case compiles an entry for one model,
then serves a model that differs only there from a new cache_compile on the same cache folder
(what a restarted process does), and compares with eager over 6 calls with fresh inputs."""

from __future__ import annotations

import enum
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from npugraph_cache import CacheWarning, _compat, cache_compile
from torch._dynamo.utils import counters

pytestmark = pytest.mark.skipif(not _compat.has_aot_compile(),
                                reason=f"torch {torch.__version__}: no disk cache (no aot_compile)")


class Kind(enum.Enum):
    CAUSAL = 1
    FULL = 2


class Double(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class Triple(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3


class Layer(torch.nn.Module):
    """Config values as a model builder sets them: an activation looked up by name (F.gelu is a
    C function), a math function, a class, an enum, and the parameters' dtype."""

    def __init__(self, act: Callable[..., torch.Tensor] = F.gelu,
                 root: Callable[[float], float] = math.sqrt, post: type = Double,
                 kind: Kind = Kind.CAUSAL, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.act, self.root, self.post, self.kind = act, root, post, kind
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.lin(x.to(self.lin.weight.dtype))) * self.root(2.0)
        if self.kind is Kind.CAUSAL:
            h = h + 1
        return self.post()(h).float()


@pytest.fixture(autouse=True)
def fresh_counters() -> Iterator[None]:
    counters.clear()
    yield
    counters.clear()


def _serve(layer: Layer, cache: Path, **kwargs: Any) -> list[str]:
    """Six calls of a new cache_compile of ``layer.forward`` on ``cache`` against eager; the
    npugraph_ex cache warnings."""
    torch.manual_seed(1)
    compiled = cache_compile(layer.forward, cache_dir=cache, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CacheWarning)
        for i in range(6):
            x = torch.randn(3, 8)
            with torch.no_grad():
                want = layer(x)
            torch.testing.assert_close(compiled(x), want, rtol=0, atol=0, msg=f"call {i}")
    return [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]


@pytest.mark.parametrize(("first", "second", "named"), [
    (dict(act=F.gelu), dict(act=F.silu), "self.act"),  # BUILTIN_MATCH (a C function)
    (dict(root=math.sqrt), dict(root=math.log), "self.root is function math.log"),
    (dict(post=Double), dict(post=Triple), "self.post"),  # CLASS_MATCH
    (dict(kind=Kind.CAUSAL), dict(kind=Kind.FULL), "self.kind is Kind.FULL, was Kind.CAUSAL"),
], ids=["c-function", "math-function", "class", "enum"])
def test_an_entry_traced_with_another_function_class_or_enum_is_not_loaded(
    tmp_path: Path, first: dict[str, Any], second: dict[str, Any], named: str
) -> None:
    torch.manual_seed(0)
    assert _serve(Layer(**first), tmp_path) == []
    assert counters["npugraph_ex_cache"]["compiled"] == 1
    torch.manual_seed(0)
    [warning] = _serve(Layer(**second), tmp_path)
    assert named in warning and "recompiling" in warning
    assert counters["npugraph_ex_cache"]["compiled"] == 2
    assert counters["npugraph_ex_cache"]["loaded"] == 0
    torch.manual_seed(0)
    assert _serve(Layer(**first), tmp_path) == []  # the first model again: its entry, loaded
    assert counters["npugraph_ex_cache"]["loaded"] == 1


def test_the_dynamo_builtins_a_trace_read_do_not_reject_a_load(tmp_path: Path) -> None:
    """Dynamo puts ``__builtins_dict___N`` into the globals while tracing; a loading process has
    none, so a kept guard on it would reject every load."""
    torch.manual_seed(0)
    assert _serve(Layer(kind=Kind.FULL), tmp_path) == []
    torch.manual_seed(0)
    assert _serve(Layer(kind=Kind.FULL), tmp_path) == []
    assert counters["npugraph_ex_cache"]["loaded"] == 1


def test_parameters_of_another_dtype_get_another_entry_without_parameter_guards(
    tmp_path: Path,
) -> None:
    """``x.to(self.lin.weight.dtype)`` is traced as a no-op for fp32 weights; served with fp64
    weights that entry would raise (or compute in the traced dtype)."""
    torch.manual_seed(0)
    assert _serve(Layer(), tmp_path, parameter_guards=False) == []
    torch.manual_seed(0)
    assert _serve(Layer(dtype=torch.float64), tmp_path, parameter_guards=False) == []
    assert counters["npugraph_ex_cache"]["compiled"] == 2
    assert counters["npugraph_ex_cache"]["loaded"] == 0

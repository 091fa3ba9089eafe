"""The Python values a served method may read, one case each: a module, the method's name, and
the calls to make in order, each with a change to apply first. Used by test_compile_cache.py
in-process (cold, then warm from the entries on disk) and, as a worker, in a fresh process:

    python serving_cases.py CACHE_DIR CASE[,CASE...]|all [reversed]

runs each case's calls (in reverse order with ``reversed``, without the changes), each compared
with eager on fresh inputs, and prints one JSON line:
``{"errors": {case: [...]}, "counters": {...}}``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

Change = Callable[[Any], None] | None


@dataclasses.dataclass
class Case:
    build: Callable[[], torch.nn.Module]
    method: str
    # (change to apply to the module before the call, args maker)
    calls: list[tuple[Change, Callable[[], tuple[Any, ...]]]]
    kwargs: list[dict[str, Any]] | None = None


def _x() -> torch.Tensor:
    return torch.randn(3, 6)


class Lin(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 6)


class P:
    def __init__(self, temperature: float, greedy: bool = False) -> None:
        self.temperature = temperature
        self.greedy = greedy


class Kind(enum.Enum):
    DOUBLE = 1
    HALVE = 2


class Sampler(Lin):
    def sample(self, x: torch.Tensor, p: Any) -> torch.Tensor:
        return self.lin(x) / p.temperature

    def nested(self, x: torch.Tensor, p: Any) -> torch.Tensor:
        return self.lin(x) / p.inner.temperature

    def pick(self, x: torch.Tensor, p: Any) -> torch.Tensor:
        y = self.lin(x)
        return y.argmax(-1) if p.greedy else y

    def to_dtype(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.lin(x).to(dtype)

    def kind(self, x: torch.Tensor, kind: Kind) -> torch.Tensor:
        y = self.lin(x)
        return y * 2 if kind is Kind.DOUBLE else y / 2

    def apply(self, x: torch.Tensor, fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        return fn(self.lin(x))

    def scales(self, x: torch.Tensor, *scales: float) -> torch.Tensor:
        y = self.lin(x)
        for s in scales:
            y = y * s
        return y

    def keyed(self, x: torch.Tensor, **kw: float) -> torch.Tensor:
        return self.lin(x) * kw["a"] - kw["b"]

    def ordered(self, x: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([self.lin(x), *parts.values()], dim=-1)

    def layers(self, x: torch.Tensor, mods: torch.nn.ModuleList) -> torch.Tensor:
        y = self.lin(x)
        for m in mods:
            y = m(y)
        return y

    def default(self, x: torch.Tensor, t: float = 1.0) -> torch.Tensor:
        return self.lin(x) * t


def _double(y: torch.Tensor) -> torch.Tensor:
    return y * 2


def _shift(y: torch.Tensor) -> torch.Tensor:
    return y + 1


class Scaler:
    def __init__(self, k: float) -> None:
        self.k = k

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        return y * self.k


class Sub(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 2.0

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return y * self.scale


class Attrs(Lin):
    def __init__(self) -> None:
        super().__init__()
        self.eps = 0.5
        self.flag = True
        self.ws = [1.0, 2.0]
        self.cfg = {"gain": 2.0}
        self.fn = lambda y: y * 2
        self.sub = Sub()
        self.k = 4
        self.act: torch.nn.Module = torch.nn.ReLU()

    def eps_(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.eps

    def flag_(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * 3 if self.flag else y

    def list_(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.ws[1]

    def dict_(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.cfg["gain"]

    def lambda_(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.lin(x))

    def sub_(self, x: torch.Tensor) -> torch.Tensor:
        return self.sub(self.lin(x))

    def slice_(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)[:, : self.k]

    def act_(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))

    def hooked(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + 1


GAINS = {"gain": 2.0}
WEIGHTS = [1.0, 2.0]
FN = lambda y: y * 2  # noqa: E731 - a global lambda is the case


class Globals(Lin):
    def dict_(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * GAINS["gain"]

    def list_(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * WEIGHTS[1]

    def lambda_(self, x: torch.Tensor) -> torch.Tensor:
        return FN(self.lin(x))


def _set(name: str, value: Any) -> Change:
    def change(m: Any) -> None:
        obj = m
        *path, last = name.split(".")
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, last, value)
    return change


def _global(name: str, value: Any) -> Change:
    def change(m: Any) -> None:
        globals()[name] = value
    return change


def _reset_globals() -> None:
    global GAINS, WEIGHTS, FN
    GAINS = {"gain": 2.0}
    WEIGHTS = [1.0, 2.0]
    FN = lambda y: y * 2  # noqa: E731


def _item(container: str, key: Any, value: Any) -> Change:
    def change(m: Any) -> None:
        getattr(m, container)[key] = value
    return change


def _hook(m: Any) -> None:
    m.lin.register_forward_hook(lambda mod, args, out: out * 10)


def _calls(*steps: tuple[Change, Callable[[], tuple[Any, ...]]]) -> list[Any]:
    return list(steps)


def _args(*values: Any) -> Callable[[], tuple[Any, ...]]:
    return lambda: (_x(), *values)


NS = types.SimpleNamespace
CASES: dict[str, Case] = {
    "object_attribute": Case(Sampler, "sample", _calls((None, _args(P(0.5))), (None, _args(P(2.0))))),
    "namespace_attribute": Case(Sampler, "sample", _calls(
        (None, _args(NS(temperature=0.5))), (None, _args(NS(temperature=2.0))))),
    "nested_attribute": Case(Sampler, "nested", _calls(
        (None, _args(NS(inner=NS(temperature=0.5)))), (None, _args(NS(inner=P(2.0)))))),
    "flag_changes_shape": Case(Sampler, "pick", _calls(
        (None, _args(P(1.0, greedy=False))), (None, _args(P(1.0, greedy=True))))),
    "dtype_argument": Case(Sampler, "to_dtype", _calls(
        (None, _args(torch.float32)), (None, _args(torch.float64)))),
    "enum_argument": Case(Sampler, "kind", _calls(
        (None, _args(Kind.DOUBLE)), (None, _args(Kind.HALVE)))),
    "function_argument": Case(Sampler, "apply", _calls(
        (None, _args(_double)), (None, _args(_shift)), (None, _args(torch.tanh)))),
    "partial_argument": Case(Sampler, "apply", _calls(
        (None, _args(functools.partial(torch.mul, other=2.0))),
        (None, _args(functools.partial(torch.mul, other=3.0))))),
    "module_argument": Case(Sampler, "apply", _calls(
        (None, _args(torch.nn.ReLU())), (None, _args(torch.nn.Tanh())))),
    "callable_object_argument": Case(Sampler, "apply", _calls(
        (None, _args(Scaler(2.0))), (None, _args(Scaler(3.0))))),
    "floats_in_varargs": Case(Sampler, "scales", _calls(
        (None, _args(0.5, 2.0)), (None, _args(0.5, 3.0)))),
    "floats_in_kwargs": Case(Sampler, "keyed", _calls(
        (None, _args()), (None, _args())), kwargs=[{"a": 0.5, "b": 1.0}, {"a": 2.0, "b": 1.0}]),
    "dict_key_order": Case(Sampler, "ordered", _calls(
        (None, lambda: (_x(), {"a": torch.zeros(3, 1), "b": torch.ones(3, 2)})),
        (None, lambda: (_x(), {"b": torch.ones(3, 2), "a": torch.zeros(3, 1)})))),
    "module_list_length": Case(Sampler, "layers", _calls(
        (None, _args(torch.nn.ModuleList([Sub(), Sub()]))),
        (None, _args(torch.nn.ModuleList([Sub()]))))),
    "attribute_float": Case(Attrs, "eps_", _calls((None, _args()), (_set("eps", 3.0), _args()))),
    "attribute_flag": Case(Attrs, "flag_", _calls((None, _args()), (_set("flag", False), _args()))),
    "attribute_list": Case(Attrs, "list_", _calls((None, _args()), (_item("ws", 1, 5.0), _args()))),
    "attribute_dict": Case(Attrs, "dict_", _calls(
        (None, _args()), (_item("cfg", "gain", 5.0), _args()))),
    "attribute_lambda": Case(Attrs, "lambda_", _calls(
        (None, _args()), (_set("fn", lambda y: y - 7), _args()))),
    "submodule_attribute": Case(Attrs, "sub_", _calls(
        (None, _args()), (_set("sub.scale", 5.0), _args()))),
    "slice_bound": Case(Attrs, "slice_", _calls((None, _args()), (_set("k", 2), _args()))),
    "submodule_of_another_class": Case(Attrs, "act_", _calls(
        (None, _args()), (_set("act", torch.nn.Tanh()), _args()))),
    "hook_added_later": Case(Attrs, "hooked", _calls((None, _args()), (_hook, _args()))),
    "global_dict": Case(Globals, "dict_", _calls(
        (None, _args()), (_global("GAINS", {"gain": 5.0}), _args()))),
    "global_list": Case(Globals, "list_", _calls(
        (None, _args()), (_global("WEIGHTS", [1.0, 5.0]), _args()))),
    "global_lambda": Case(Globals, "lambda_", _calls(
        (None, _args()), (_global("FN", lambda y: y - 7), _args()))),
}


def run(case_name: str, cache_dir: str, order: str = "forward",
        cache_compile: Callable[..., Any] | None = None) -> list[str]:
    """Run a case's calls against eager; the errors found (empty: every call matched)."""
    if cache_compile is None:
        from npugraph_cache import cache_compile
    _reset_globals()
    case = CASES[case_name]
    steps = list(enumerate(case.calls))
    if order == "reversed":
        steps.reverse()
    module = case.build().eval()
    served = cache_compile(getattr(module, case.method), cache_dir=cache_dir)
    errors = []
    for i, (change, make) in steps:
        if change is not None and order == "forward":
            change(module)
        args = make()
        kwargs = case.kwargs[i] if case.kwargs else {}
        for _ in range(2):  # the replay path, not only the first call
            got = served(*args, **kwargs)
            with torch.no_grad():
                want = getattr(module, case.method)(*args, **kwargs)
            if got.shape != want.shape or got.dtype != want.dtype or not torch.allclose(
                    got, want, rtol=1e-5, atol=1e-6):
                errors.append(f"call {i}: {tuple(got.shape)} {got.dtype} vs eager "
                              f"{tuple(want.shape)} {want.dtype}")
                break
    return errors


if __name__ == "__main__":
    import warnings

    import serving_cases  # the classes by their module's name, as the first process keyed them
    from torch._dynamo.utils import counters

    warnings.simplefilter("ignore")  # a changed value's recompile warns; the errors are the result
    # a fresh process whose first calls use the other values: the entries the changes selected
    # or compiled in the first process are found by their values
    names = list(CASES) if sys.argv[2] == "all" else sys.argv[2].split(",")
    order = sys.argv[3] if len(sys.argv) > 3 else "forward"
    found = {name: serving_cases.run(name, sys.argv[1], order) for name in names}
    print(json.dumps({"errors": found, "counters": dict(counters["npugraph_ex_cache"])}))

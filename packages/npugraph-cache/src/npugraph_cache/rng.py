"""Refuse graphs that draw random numbers: a cached graph would replay the RNG state of the
process that compiled it, which is not what eager does (a documented limit of cache_compile)."""

from __future__ import annotations

import torch

from npugraph_cache._compat import is_seeded_op
from npugraph_cache.errors import CacheError

_RNG_FUNCTIONS = frozenset(
    {
        "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
        "bernoulli", "multinomial", "normal", "poisson", "rrelu", "native_dropout",
    }
)  # fmt: skip
_RNG_METHODS = frozenset(
    {
        "uniform_", "normal_", "bernoulli_", "bernoulli", "random_", "exponential_", "cauchy_",
        "geometric_", "log_normal_", "multinomial",
    }
)  # fmt: skip
_DROPOUTS = frozenset(
    {"dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d"}
)


class RngGraphError(CacheError, RuntimeError):
    """cache_compile was given a function whose graph uses random numbers."""


def _dropout_training(node: torch.fx.Node) -> bool:
    training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
    # a graph value (not a constant) could be True at run time
    return training is not False


def _sdpa_dropout(node: torch.fx.Node) -> bool:
    p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
    return not (isinstance(p, int | float) and p == 0)


def rng_nodes(gm: torch.fx.GraphModule) -> list[str]:
    """Human-readable descriptions of every node of a dynamo graph that draws random numbers."""
    found: list[str] = []
    for node in gm.graph.nodes:
        name = ""
        if node.op == "call_function":
            target = node.target
            name = getattr(target, "__name__", str(target))
            random = (
                is_seeded_op(target)
                or name in _RNG_FUNCTIONS
                or (name in _DROPOUTS and _dropout_training(node))
                or (name == "scaled_dot_product_attention" and _sdpa_dropout(node))
            )
            if not random:
                continue
        elif node.op == "call_method" and node.target in _RNG_METHODS:
            name = f"Tensor.{node.target}"
        else:
            continue
        where = node.meta.get("stack_trace", "").strip().splitlines()
        found.append(
            f"{node.name} ({name})" + (f" at {where[-2].strip()}" if len(where) > 1 else "")
        )
    return found


def refuse_rng(gm: torch.fx.GraphModule, func_name: str) -> None:
    nodes = rng_nodes(gm)
    if nodes:
        raise RngGraphError(
            f"cache_compile cannot cache {func_name}: its graph draws random numbers "
            f"({'; '.join(nodes)}). A cached graph would not follow the RNG state of the loading "
            "process. Remove the random ops (e.g. call module.eval() to disable dropout) or use "
            "torch.compile without cache_compile."
        )

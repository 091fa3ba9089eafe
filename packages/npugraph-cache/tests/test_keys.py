"""A change in anything that changes the compiled result gives another key."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from npugraph_cache.keys import build_key, input_spec, rank_component


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)


class SmallOtherForward(Small):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * 2


class SmallOtherStep(Small):
    def step(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x) + 1


def _key(module: Small, x: torch.Tensor, **overrides: Any) -> str:
    kw: dict[str, Any] = {
        "dynamic": True,
        "options": None,
        "custom_decompositions": None,
        "rank": "",
        "key_extra": None,
    }
    kw.update(overrides)
    return build_key(module.step, module, (x,), {}, **kw).digest()


def test_same_inputs_give_the_same_key() -> None:
    m = Small()
    assert _key(m, torch.randn(3, 4)) == _key(Small(), torch.randn(3, 4))


def test_key_changes_with_options() -> None:
    m, x = Small(), torch.randn(3, 4)
    assert _key(m, x, options={"force_eager": True}) != _key(m, x, options={"force_eager": False})


def test_key_changes_with_a_user_pass_source() -> None:
    def pass_a(gm: Any, inputs: Any, config: Any) -> None:
        return None

    def pass_b(gm: Any, inputs: Any, config: Any) -> None:
        gm.graph.lint()

    m, x = Small(), torch.randn(3, 4)
    assert _key(m, x, options={"post_grad_custom_pre_pass": pass_a}) != _key(
        m, x, options={"post_grad_custom_pre_pass": pass_b}
    )


def test_key_changes_with_the_methods_source_and_the_forwards_source() -> None:
    x = torch.randn(3, 4)
    base = _key(Small(), x)
    assert _key(SmallOtherStep(), x) != base
    assert _key(SmallOtherForward(), x) != base


def test_key_changes_with_dtype_device_rank_and_extra() -> None:
    m, x = Small(), torch.randn(3, 4)
    base = _key(m, x)
    assert _key(m, x.double()) != base
    assert _key(m, torch.randn(3, 4, device="meta")) != base
    assert _key(m, x, rank="world2global_rank1") != base
    assert _key(m, x, key_extra={"config": "abc"}) != base
    assert _key(m, x, dynamic=False) != base


def test_static_key_changes_with_shape_dynamic_key_does_not() -> None:
    m = Small()
    assert _key(m, torch.randn(3, 4), dynamic=False) != _key(m, torch.randn(5, 4), dynamic=False)
    assert _key(m, torch.randn(3, 4)) == _key(m, torch.randn(5, 4))
    # dynamo specialises sizes 0 and 1 even when dynamic
    assert _key(m, torch.randn(1, 4)) != _key(m, torch.randn(5, 4))


@dataclasses.dataclass
class Meta:
    data: torch.Tensor
    is_prompt: bool


def test_input_spec_walks_dataclasses_and_lists_with_duck_shaped_dims() -> None:
    spec = input_spec(
        (Meta(torch.randn(6, 4), True), [torch.randn(6, 4), torch.randn(7, 4)]), {}, True
    )
    meta, kv = spec["args"]
    assert meta["fields"]["is_prompt"] is True
    assert meta["fields"]["data"]["shape"] == ["s0", "s1"]
    assert [t["shape"] for t in kv["list"]] == [["s0", "s1"], ["s2", "s1"]]


def test_rank_component_without_distributed() -> None:
    assert rank_component(None, None, None) == ""
    assert rank_component(3, 1, 0) == "world1global_rank3_tp_rank1_pp_rank0"

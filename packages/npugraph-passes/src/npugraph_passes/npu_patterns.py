"""Ascend fusion rules, registered only when torch_npu provides every op a rule uses.

* ``npu_add_rms_norm`` + ``npu_dynamic_quant`` -> ``npu_add_rms_norm_dynamic_quant``
  (with and without epsilon, with and without the residual output, and quantising
  ``y.flatten(0, 1)`` with ``scale.view(-1, 1)``);
* ``npu_add_rms_norm`` + cast to float32 (also through ``view(-1, h)``) -> ``npu_add_rms_norm_cast``;
* ``npu_add_rms_norm`` + ``npu_quantize`` (last axis) -> ``npu_add_rms_norm_quant``;
* ``bmm`` + ``transpose(0, 1)`` -> ``npu_transpose_batchmatmul`` (3-D half/bfloat16/float
  inputs, K and N multiples of 128, K < 65536).

A rule that cannot be traced on the installed torch_npu is skipped with a warning naming it.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any

import torch

from npugraph_passes import _compat

log = logging.getLogger("npugraph_ex")


def _npu_op(name: str) -> Any:
    namespace = getattr(torch.ops, "npu", None)
    if namespace is None:
        return None
    try:
        return getattr(namespace, name).default
    except (AttributeError, RuntimeError):
        return None


def _have(*names: str) -> bool:
    return all(_npu_op(n) is not None for n in names)


def _always(match: Any) -> bool:
    return True


def _tbmm_check(match: Any) -> bool:
    a = match.kwargs.get("x1")
    b = match.kwargs.get("x2")
    va = a.meta.get("val") if a is not None else None
    vb = b.meta.get("val") if b is not None else None
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
        return False
    if va.dim() != 3 or vb.dim() != 3 or va.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    k, n = va.shape[2], vb.shape[2]
    return isinstance(k, int) and isinstance(n, int) and k % 128 == 0 and n % 128 == 0 and k < 65536


def _quant_check(match: Any) -> bool:
    """What the fused kernel accepts: half/bfloat16 inputs of one dtype, a last dimension of a
    multiple of 32 bytes, scales shaped like gamma, zero points that are not int8/uint8."""
    vals = {k: (v.meta.get("val") if hasattr(v, "meta") else None) for k, v in match.kwargs.items()}
    x1, x2, gamma, scales, zp = (vals.get(k) for k in ("x1", "x2", "gamma", "scales", "zero_points"))
    if not all(isinstance(t, torch.Tensor) for t in (x1, x2, gamma, scales)):
        return False
    assert isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor)
    assert isinstance(gamma, torch.Tensor) and isinstance(scales, torch.Tensor)
    last = x1.shape[-1]
    return (
        x1.dtype == x2.dtype
        and x1.dtype in (torch.float16, torch.bfloat16)
        and isinstance(last, int) and (last * x1.element_size()) % 32 == 0
        and tuple(gamma.shape) == tuple(scales.shape)
        and not (isinstance(zp, torch.Tensor) and zp.dtype in (torch.int8, torch.uint8))
    )


def _rules() -> list[tuple[str, tuple[str, ...], Callable[..., Any], Callable[..., Any], str, Callable[[Any], bool], dict[str, float] | None]]:
    def arn(*a: Any) -> Any:
        return _npu_op("npu_add_rms_norm")(*a)

    def dq_search(x1: Any, x2: Any, gamma: Any, smooth: Any) -> Any:
        y, _, x = arn(x1, x2, gamma)
        q, s = _npu_op("npu_dynamic_quant")(y, smooth_scales=smooth)
        return q, x, s

    def dq_replace(x1: Any, x2: Any, gamma: Any, smooth: Any) -> Any:
        q, _, x, s, _ = _npu_op("npu_add_rms_norm_dynamic_quant")(
            x1, x2, gamma, smooth_scale1=smooth, output_mask=[True, False])
        return q, x, s

    def dq_eps_search(x1: Any, x2: Any, gamma: Any, smooth: Any, epsilon: float) -> Any:
        y, _, x = arn(x1, x2, gamma, epsilon)
        q, s = _npu_op("npu_dynamic_quant")(y, smooth_scales=smooth)
        return q, x, s

    def dq_eps_replace(x1: Any, x2: Any, gamma: Any, smooth: Any, epsilon: float) -> Any:
        q, _, x, s, _ = _npu_op("npu_add_rms_norm_dynamic_quant")(
            x1, x2, gamma, smooth_scale1=smooth, epsilon=epsilon, output_mask=[True, False])
        return q, x, s

    def dq_noxout_search(x1: Any, x2: Any, gamma: Any, smooth: Any) -> Any:
        y, _, _ = arn(x1, x2, gamma)
        return _npu_op("npu_dynamic_quant")(y, smooth_scales=smooth)

    def dq_noxout_replace(x1: Any, x2: Any, gamma: Any, smooth: Any) -> Any:
        q, _, _, s, _ = _npu_op("npu_add_rms_norm_dynamic_quant")(
            x1, x2, gamma, smooth_scale1=smooth, output_mask=[True, False])
        return q, s

    def cast_search(x1: Any, x2: Any, gamma: Any) -> Any:
        y, _, x = arn(x1, x2, gamma)
        return y, x, y.to(torch.float32)

    def cast_replace(x1: Any, x2: Any, gamma: Any) -> Any:
        y32, y, _, x = _npu_op("npu_add_rms_norm_cast")(x1, x2, gamma)
        return y, x, y32

    def quant_search(x1: Any, x2: Any, gamma: Any, scales: Any, zero_points: Any) -> Any:
        y, _, x = arn(x1, x2, gamma)
        q = _npu_op("npu_quantize")(y, scales, zero_points, torch.qint8, -1, True)
        return q, x

    def quant_replace(x1: Any, x2: Any, gamma: Any, scales: Any, zero_points: Any) -> Any:
        q, _, x = _npu_op("npu_add_rms_norm_quant")(x1, x2, gamma, scales, zero_points, axis=-1, div_mode=True)
        return q, x

    def tbmm_search(x1: Any, x2: Any) -> Any:
        return torch.bmm(x1, x2).transpose(0, 1)

    def tbmm_replace(x1: Any, x2: Any) -> Any:
        return _npu_op("npu_transpose_batchmatmul")(x1, x2, perm_x1=[0, 1, 2], perm_x2=[0, 1, 2], perm_y=[1, 0, 2])

    norm = ("npu_add_rms_norm",)
    eps = {"epsilon": 2e-6}
    return [
        ("add_rms_norm_dynamic_quant", (*norm, "npu_dynamic_quant", "npu_add_rms_norm_dynamic_quant"),
         dq_search, dq_replace, "norm4", _always, None),
        ("add_rms_norm_dynamic_quant_epsilon", (*norm, "npu_dynamic_quant", "npu_add_rms_norm_dynamic_quant"),
         dq_eps_search, dq_eps_replace, "norm4", _always, eps),
        ("add_rms_norm_dynamic_quant_no_residual", (*norm, "npu_dynamic_quant", "npu_add_rms_norm_dynamic_quant"),
         dq_noxout_search, dq_noxout_replace, "norm4", _always, None),
        ("add_rms_norm_cast", (*norm, "npu_add_rms_norm_cast"), cast_search, cast_replace, "norm3", _always, None),
        ("add_rms_norm_quant", (*norm, "npu_quantize", "npu_add_rms_norm_quant"),
         quant_search, quant_replace, "norm5", _quant_check, None),
        ("transpose_batchmatmul", ("npu_transpose_batchmatmul",), tbmm_search, tbmm_replace, "bmm", _tbmm_check, None),
    ]


def _examples(kind: str) -> list[torch.Tensor]:
    half = torch.float16
    if kind == "bmm":
        return [torch.empty(2, 2, 128, dtype=half), torch.empty(2, 128, 128, dtype=half)]
    base = [torch.empty(1, 1, 2, dtype=half), torch.empty(1, 1, 2, dtype=half), torch.empty(2, dtype=half)]
    if kind == "norm3":
        return base
    if kind == "norm4":
        return [*base, torch.empty(2, dtype=half)]
    return [*base, torch.empty(2, dtype=half), torch.empty(2, dtype=half)]


def _view_node(match: Any, base_target: Any) -> Any:
    return next((n for n in match.nodes if n.target is torch.ops.aten.view.default
                 and getattr(n.args[0], "target", None) is operator.getitem
                 and getattr(n.args[0].args[0], "target", None) is base_target), None)


def _x1_shape(match: Any) -> tuple[Any, ...] | None:
    x1 = match.kwargs.get("x1")
    val = x1.meta.get("val") if x1 is not None else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _flatten_check(match: Any) -> bool:
    """The view feeding the quantisation merges the first two dimensions of a 3-D input."""
    shape, view = _x1_shape(match), _view_node(match, _npu_op("npu_add_rms_norm"))
    if shape is None or view is None or len(shape) != 3:
        return False
    size = list(view.args[1])
    return len(size) == 2 and size[1] in (shape[2], -1) and size[0] in (shape[0] * shape[1], -1)


def _last_dim_check(match: Any) -> bool:
    """The view before the cast is ``view(-1, h)`` with ``h`` the input's last dimension."""
    shape, view = _x1_shape(match), _view_node(match, _npu_op("npu_add_rms_norm"))
    if shape is None or view is None:
        return False
    size = list(view.args[1])
    return len(size) == 2 and size[0] == -1 and size[1] == shape[-1]


def _view_rules(with_epsilon: bool) -> list[tuple[str, tuple[str, ...], Callable[..., Any], Callable[..., Any], str, Callable[[Any], bool], Any, dict[str, float] | None]]:
    """Rules whose search side has views of data-dependent sizes: their patterns are built by
    hand (sizes ignored, checked by the extra check) instead of traced."""
    pm = _compat.pattern_matcher()
    aten = torch.ops.aten
    norm_op = _npu_op("npu_add_rms_norm")
    eps_args = [pm.KeywordArg("epsilon")] if with_epsilon else []
    suffix = "_epsilon" if with_epsilon else ""

    def norm() -> Any:
        return pm.CallFunction(norm_op, pm.KeywordArg("x1"), pm.KeywordArg("x2"), pm.KeywordArg("gamma"),
                               *eps_args, _users=2)

    n1 = norm()
    quant = pm.CallFunction(_npu_op("npu_dynamic_quant"),
                            pm.CallFunction(aten.view.default, pm.CallFunction(operator.getitem, n1, 0), pm.Ignored()),
                            _users=2)
    dq_pattern = pm.MultiOutputPattern([
        pm.CallFunction(operator.getitem, quant, 0),
        pm.CallFunction(aten.view.default, pm.CallFunction(operator.getitem, quant, 1), [-1, 1]),
        pm.CallFunction(operator.getitem, n1, 2),
    ])
    n2 = norm()
    y = pm.CallFunction(operator.getitem, n2, 0, _users=2)
    cast_pattern = pm.MultiOutputPattern([
        y,
        pm.CallFunction(operator.getitem, n2, 2),
        pm.CallFunction(aten._to_copy.default, pm.CallFunction(aten.view.default, y, [-1, pm.Ignored()]),
                        dtype=torch.float32),
    ])

    def eps_kw(epsilon: Any) -> dict[str, Any]:
        return {"epsilon": epsilon} if with_epsilon else {}

    def dq_search(x1: Any, x2: Any, gamma: Any, epsilon: Any = None) -> Any:
        raise NotImplementedError  # the hand-built pattern is used instead

    def dq_replace(x1: Any, x2: Any, gamma: Any, epsilon: Any = None) -> Any:
        q, _, x, scale, _ = _npu_op("npu_add_rms_norm_dynamic_quant")(
            x1, x2, gamma, output_mask=[True, False], **eps_kw(epsilon))
        return q.flatten(0, 1), scale.view(-1, 1), x

    def cast_replace(x1: Any, x2: Any, gamma: Any, epsilon: Any = None) -> Any:
        args = (epsilon,) if with_epsilon else ()
        y32, y_, _, x = _npu_op("npu_add_rms_norm_cast")(x1, x2, gamma, *args)
        return y_, x, y32.view(-1, y_.size(-1))

    if with_epsilon:
        def dq_s(x1: Any, x2: Any, gamma: Any, epsilon: Any) -> Any:
            return dq_search(x1, x2, gamma, epsilon)

        def dq_r(x1: Any, x2: Any, gamma: Any, epsilon: Any) -> Any:
            return dq_replace(x1, x2, gamma, epsilon)

        def cast_r(x1: Any, x2: Any, gamma: Any, epsilon: Any) -> Any:
            return cast_replace(x1, x2, gamma, epsilon)
    else:
        def dq_s(x1: Any, x2: Any, gamma: Any) -> Any:  # type: ignore[misc]
            return dq_search(x1, x2, gamma)

        def dq_r(x1: Any, x2: Any, gamma: Any) -> Any:  # type: ignore[misc]
            return dq_replace(x1, x2, gamma)

        def cast_r(x1: Any, x2: Any, gamma: Any) -> Any:  # type: ignore[misc]
            return cast_replace(x1, x2, gamma)

    scalars = {"epsilon": 2e-6} if with_epsilon else None
    return [
        (f"add_rms_norm_dynamic_quant_flatten{suffix}", ("npu_add_rms_norm", "npu_dynamic_quant",
                                                         "npu_add_rms_norm_dynamic_quant"),
         dq_s, dq_r, "norm3", _flatten_check, dq_pattern, scalars),
        (f"add_rms_norm_cast_view{suffix}", ("npu_add_rms_norm", "npu_add_rms_norm_cast"),
         dq_s, cast_r, "norm3", _last_dim_check, cast_pattern, scalars),
    ]


def register_npu_patterns(register: Callable[..., None]) -> int:
    """Registers the NPU rules whose ops exist (none without torch_npu); returns how many."""
    if getattr(torch.ops, "npu", None) is None or (not _have("npu_add_rms_norm") and not _have(
        "npu_transpose_batchmatmul"
    )):
        return 0
    rules = [(name, ops, search, replace, kind, check, None, scalars)
             for name, ops, search, replace, kind, check, scalars in _rules()]
    if _have("npu_add_rms_norm", "npu_dynamic_quant", "npu_add_rms_norm_dynamic_quant", "npu_add_rms_norm_cast"):
        rules += _view_rules(False) + _view_rules(True)
    count = 0
    for name, ops, search, replace, kind, check, pattern, scalars in rules:
        if not _have(*ops):
            continue
        try:
            with _compat.fake_tensor_mode():
                register(search, replace, _examples(kind), _compat.fwd_only_no_decomp, check, pattern, scalars, False)
        except Exception as exc:
            log.warning("npugraph_ex: NPU fusion rule %s could not be traced (%s); it is skipped", name, exc)
            continue
        count += 1
    return count

"""Stand-ins for torch_npu's fusion-related ops, for hardware we do not have: torch_npu's schemas
with CPU reference kernels. Used only by test_npu_patterns.py, in a subprocess."""

from __future__ import annotations

from typing import Any

import torch

lib = torch.library.Library("npu", "DEF")
for schema in (
    "npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)",
    "npu_dynamic_quant(Tensor input, *, Tensor? smooth_scales=None, Tensor? group_index=None, "
    "ScalarType? dst_type=None) -> (Tensor, Tensor)",
    "npu_add_rms_norm_dynamic_quant(Tensor x1, Tensor x2, Tensor gamma, *, Tensor? smooth_scale1=None, "
    "Tensor? smooth_scale2=None, Tensor? beta=None, float epsilon=1e-06, bool[]? output_mask=None) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "npu_add_rms_norm_cast(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor, Tensor)",
    "npu_quantize(Tensor input, Tensor scales, Tensor? zero_points, ScalarType dtype, int axis=1, "
    "bool div_mode=True) -> Tensor",
    "npu_add_rms_norm_quant(Tensor x1, Tensor x2, Tensor gamma, Tensor scales1, Tensor? zero_points1, "
    "Tensor? beta=None, Tensor? scales2=None, Tensor? zero_points2=None, *, int axis=-1, "
    "float epsilon=1e-06, bool div_mode=True) -> (Tensor, Tensor, Tensor)",
    "npu_transpose_batchmatmul(Tensor input, Tensor weight, *, Tensor? bias=None, Tensor? scale=None, "
    "int[]? perm_x1=None, int[]? perm_x2=None, int[]? perm_y=None, int? batch_split_factor=1) -> Tensor",
):
    lib.define(schema)


def _norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
    x = x1 + x2
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * gamma.float()).to(x1.dtype), rstd, x


def _dynamic_quant(y: torch.Tensor, smooth: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    yf = y.float() * (smooth.float() if smooth is not None else 1.0)
    scale = yf.abs().amax(-1).clamp_min(1e-6) / 127.0
    return torch.round(yf / scale[..., None]).to(torch.int8), scale


def _quant(y: torch.Tensor, scales: torch.Tensor, zp: torch.Tensor | None, div: bool) -> torch.Tensor:
    q = y.float() / scales.float() if div else y.float() * scales.float()
    if zp is not None:
        q = q + zp.float()
    return torch.round(q).clamp(-128, 127).to(torch.int8)


def npu_add_rms_norm(x1: Any, x2: Any, gamma: Any, epsilon: float = 1e-6) -> Any:
    return _norm(x1, x2, gamma, epsilon)


def npu_dynamic_quant(input: Any, smooth_scales: Any = None, group_index: Any = None, dst_type: Any = None) -> Any:
    return _dynamic_quant(input, smooth_scales)


def npu_add_rms_norm_dynamic_quant(x1: Any, x2: Any, gamma: Any, smooth_scale1: Any = None, smooth_scale2: Any = None,
                                   beta: Any = None, epsilon: float = 1e-6, output_mask: Any = None) -> Any:
    y, _, x = _norm(x1, x2, gamma, epsilon)
    q, s = _dynamic_quant(y, smooth_scale1)
    return q, torch.empty_like(q), x, s, torch.empty_like(s)


def npu_add_rms_norm_cast(x1: Any, x2: Any, gamma: Any, epsilon: float = 1e-6) -> Any:
    y, rstd, x = _norm(x1, x2, gamma, epsilon)
    return y.float(), y, rstd, x


def npu_quantize(input: Any, scales: Any, zero_points: Any, dtype: Any, axis: int = 1, div_mode: bool = True) -> Any:
    return _quant(input, scales, zero_points, div_mode)


def npu_add_rms_norm_quant(x1: Any, x2: Any, gamma: Any, scales1: Any, zero_points1: Any, beta: Any = None,
                           scales2: Any = None, zero_points2: Any = None, axis: int = -1, epsilon: float = 1e-6,
                           div_mode: bool = True) -> Any:
    y, _, x = _norm(x1, x2, gamma, epsilon)
    q = _quant(y, scales1, zero_points1, div_mode)
    return q, torch.empty_like(q), x


def npu_transpose_batchmatmul(input: Any, weight: Any, bias: Any = None, scale: Any = None, perm_x1: Any = None,
                              perm_x2: Any = None, perm_y: Any = None, batch_split_factor: Any = 1) -> Any:
    return torch.bmm(input, weight).transpose(0, 1).contiguous()


for _fn in (npu_add_rms_norm, npu_dynamic_quant, npu_add_rms_norm_dynamic_quant, npu_add_rms_norm_cast,
            npu_quantize, npu_add_rms_norm_quant, npu_transpose_batchmatmul):
    lib.impl(_fn.__name__, _fn, "CPU")
    lib.impl(_fn.__name__, _fn, "Meta")

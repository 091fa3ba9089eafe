"""The Ascend fusion rules, exercised on stand-ins of torch_npu's ops (no Ascend hardware here:
tests/npu_standin.py defines the ops with torch_npu's schemas and CPU kernels). Each case runs in
a subprocess because the rules are registered once per process, when the ops exist."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("torch_npu") is not None,
        reason="torch_npu is installed: its real ops would clash with the stand-ins",
    ),
    pytest.mark.numerics,  # fused graphs against the original, under two kernel variants in CI
]

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    import npu_standin  # noqa: F401
    from npugraph_passes._compat import aot_inference_graph
    from npugraph_passes.fusion import pattern_fusion_pass

    npu, h = torch.ops.npu, torch.float16

    def close(a, b):  # dtype tolerances: the fused graph runs other kernels than the original
        try:
            torch.testing.assert_close(a, b)
        except AssertionError:
            return False
        return True

    def dq(x1, x2, g, s):
        y, _, x = npu.npu_add_rms_norm(x1, x2, g)
        q, sc = npu.npu_dynamic_quant(y, smooth_scales=s)
        return q, x, sc

    def dq_eps(x1, x2, g, s):
        y, _, x = npu.npu_add_rms_norm(x1, x2, g, 1e-5)
        q, sc = npu.npu_dynamic_quant(y, smooth_scales=s)
        return q, x, sc

    def cast(x1, x2, g):
        y, _, x = npu.npu_add_rms_norm(x1, x2, g)
        return y, x, y.to(torch.float32)

    def quant(x1, x2, g, s, zp):
        y, _, x = npu.npu_add_rms_norm(x1, x2, g)
        return npu.npu_quantize(y, s, zp, torch.qint8, -1, True), x

    def dq_flatten(x1, x2, g):
        y, _, x = npu.npu_add_rms_norm(x1, x2, g)
        q, sc = npu.npu_dynamic_quant(y.flatten(0, 1))
        return q, sc.view(-1, 1), x

    def dq_flatten_eps(x1, x2, g):
        y, _, x = npu.npu_add_rms_norm(x1, x2, g, 1e-5)
        q, sc = npu.npu_dynamic_quant(y.flatten(0, 1))
        return q, sc.view(-1, 1), x

    def cast_view(x1, x2, g):
        y, _, x = npu.npu_add_rms_norm(x1, x2, g)
        return y, x, y.view(-1, y.size(-1)).to(torch.float32)

    def cast_view_eps(x1, x2, g):
        y, _, x = npu.npu_add_rms_norm(x1, x2, g, 1e-5)
        return y, x, y.view(-1, y.size(-1)).to(torch.float32)

    def cast_view_other(x1, x2, g):
        y, _, x = npu.npu_add_rms_norm(x1, x2, g)
        return y, x, y.view(-1, 8).to(torch.float32)

    def tbmm(a, b):
        return (torch.bmm(a, b).transpose(0, 1),)

    def t(*shape, dtype=h):
        return torch.randn(*shape, dtype=dtype)

    cases = {
        "dq": (dq, [t(2, 3, 16), t(2, 3, 16), t(16), t(16).abs()]),
        "dq_eps": (dq_eps, [t(2, 3, 16), t(2, 3, 16), t(16), t(16).abs()]),
        "cast": (cast, [t(2, 3, 16), t(2, 3, 16), t(16)]),
        "quant": (quant, [t(2, 3, 16), t(2, 3, 16), t(16), t(16).abs() + 0.5, torch.zeros(16, dtype=h)]),
        "quant_int8_zero_points": (quant, [t(2, 3, 16), t(2, 3, 16), t(16), t(16).abs() + 0.5,
                                           torch.zeros(16, dtype=torch.int8)]),
        "quant_float32": (quant, [t(2, 16, dtype=torch.float32), t(2, 16, dtype=torch.float32),
                                  t(16, dtype=torch.float32), t(16, dtype=torch.float32).abs() + 0.5,
                                  torch.zeros(16)]),
        "dq_flatten": (dq_flatten, [t(2, 3, 16), t(2, 3, 16), t(16)]),
        "dq_flatten_eps": (dq_flatten_eps, [t(2, 3, 16), t(2, 3, 16), t(16)]),
        "cast_view": (cast_view, [t(2, 3, 16), t(2, 3, 16), t(16)]),
        "cast_view_eps": (cast_view_eps, [t(2, 3, 16), t(2, 3, 16), t(16)]),
        "cast_view_other": (cast_view_other, [t(2, 3, 16), t(2, 3, 16), t(16)]),
        "tbmm": (tbmm, [t(4, 2, 128, dtype=torch.float32), t(4, 128, 128, dtype=torch.float32)]),
        "tbmm_small_k": (tbmm, [t(4, 2, 64, dtype=torch.float32), t(4, 64, 128, dtype=torch.float32)]),
    }
    report = {}
    for name, (fn, inputs) in cases.items():
        gm, ex = aot_inference_graph(fn, inputs)
        expected = gm(*inputs)
        pattern_fusion_pass(gm, ex, None)
        gm.recompile()
        got = gm(*inputs)
        report[name] = {
            "targets": [str(n.target) for n in gm.graph.nodes if n.op == "call_function"],
            "same": all(close(b, a) for a, b in zip(expected, got)),
        }
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def report() -> dict[str, dict[str, object]]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, dict[str, object]] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(
    ("case", "fused"),
    [
        ("dq", "npu.npu_add_rms_norm_dynamic_quant.default"),
        ("dq_eps", "npu.npu_add_rms_norm_dynamic_quant.default"),
        ("cast", "npu.npu_add_rms_norm_cast.default"),
        ("quant", "npu.npu_add_rms_norm_quant.default"),
        ("tbmm", "npu.npu_transpose_batchmatmul.default"),
        ("dq_flatten", "npu.npu_add_rms_norm_dynamic_quant.default"),
        ("dq_flatten_eps", "npu.npu_add_rms_norm_dynamic_quant.default"),
        ("cast_view", "npu.npu_add_rms_norm_cast.default"),
        ("cast_view_eps", "npu.npu_add_rms_norm_cast.default"),
    ],
)
def test_npu_rule_fires_and_keeps_results(report: dict[str, dict[str, object]], case: str, fused: str) -> None:
    assert fused in report[case]["targets"]  # type: ignore[operator]
    assert "npu.npu_add_rms_norm.default" not in report[case]["targets"]  # type: ignore[operator]
    assert report[case]["same"] is True


@pytest.mark.parametrize("case", ["quant_int8_zero_points", "quant_float32", "tbmm_small_k", "cast_view_other"])
def test_npu_rule_refuses_what_the_fused_kernel_does_not_take(report: dict[str, dict[str, object]], case: str) -> None:
    targets = report[case]["targets"]
    fused = ("npu_add_rms_norm_quant", "transpose_batchmatmul", "npu_add_rms_norm_cast")
    assert not any(f in t for f in fused for t in targets)  # type: ignore[union-attr]
    assert report[case]["same"] is True

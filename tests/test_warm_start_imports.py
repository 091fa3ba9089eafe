"""A warm start (a process that loads its graph from cache_compile's entry) imports neither the
passes, nor the debugging/dump aids, nor the façade's extras: they cost a warm start most of its
time outside torch (issue 13 item 6). The cold process, which runs the passes, does import them,
so this fails if the compile stops running them or the warm start starts importing them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from npugraph_cache import _compat

WORKER = Path(__file__).with_name("warm_start_worker.py")
pytestmark = pytest.mark.skipif(not _compat.has_aot_compile(),
                                reason=f"torch {torch.__version__}: no disk cache (no aot_compile)")

# Needed only to compile (passes, stream lowering) or to debug/dump (dfx); never by a loaded entry.
COMPILE_ONLY = (
    "npugraph_passes.cat",
    "npugraph_passes.cleanup",
    "npugraph_passes.fusion",
    "npugraph_passes.lint",
    "npugraph_passes.noop",
    "npugraph_passes.reinplace",
    "npugraph_passes.stream_scopes",
    "npugraph_backend.specs",
    "npugraph_backend.padding_analysis",
    "npugraph_backend.dfx.data_dump",
    "npugraph_backend.dfx.deadlock",
    "npugraph_backend.dfx.debug",
)
# Never imported by the inference path, cold or warm.
NEVER = ("npugraph_cache.readable", "npugraph_ex.bench", "npugraph_ex.demo", "npugraph_ex.hf", "npugraph_ex.models",
         "transformers")


def _run(cache_dir: Path, out: Path) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", NPUGRAPH_EX_CACHE_KEY=str(cache_dir.parent / "cache.key"))
    subprocess.run([sys.executable, str(WORKER), str(cache_dir), str(out)], env=env, check=True, timeout=240)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_a_warm_start_imports_no_pass_and_no_debug_module(tmp_path: Path) -> None:
    cold = _run(tmp_path / "cache", tmp_path / "cold.json")
    assert cold["cache"] == {"compiled": 1} and cold["captures"] >= 1 and cold["max_error"] == 0.0
    assert set(COMPILE_ONLY) <= set(cold["modules"])
    warm = _run(tmp_path / "cache", tmp_path / "warm.json")
    assert warm["cache"] == {"loaded": 1}
    assert warm["captures"] >= 1  # captured again in this process, and replayed
    assert warm["max_error"] == 0.0
    assert [m for m in COMPILE_ONLY if m in warm["modules"]] == []
    for run in (cold, warm):
        assert [m for m in run["modules"] if m.split(".")[0] == "transformers" or m in NEVER] == []


@pytest.mark.parametrize("package", ["npugraph_passes", "npugraph_ex"])
def test_lazy_exports_resolve_to_the_defining_modules_objects(package: str) -> None:
    import importlib

    module = importlib.import_module(package)
    for name in module.__all__:
        value = getattr(module, name)
        assert value is not None and name in dir(module)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        module.nope  # noqa: B018
    import npugraph_passes.fusion
    import npugraph_passes.manager

    assert npugraph_passes.register_replacement is npugraph_passes.fusion.register_replacement
    assert npugraph_passes.PassManager is npugraph_passes.manager.PassManager

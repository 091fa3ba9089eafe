"""npugraph_ex.inference.cache_compile across restarts (warm starts): what a restarted process changed (a
numerics flag, ...) either gives its own entry or is served correctly by the saved one, equal
to eager over 6 calls with fresh inputs; a new cache_compile on the same cache folder stands in
for the restarted process."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from npugraph_cache import CacheWarning, _compat
from npugraph_cache.secret import KEY_ENV
from torch._dynamo.utils import counters

from npugraph_ex.inference import cache_compile

pytestmark = pytest.mark.skipif(not _compat.has_aot_compile(),
                                reason=f"torch {torch.__version__}: no disk cache (no aot_compile)")


@pytest.fixture(autouse=True)
def own_key_and_counters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A cache key of this test's own (never the user's), and counters of this test only."""
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "cache.key"))
    counters.clear()
    yield
    counters.clear()


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q(x)
        return torch.softmax(h @ h.transpose(-1, -2), -1) @ h


def _serve(cache: Path) -> None:
    torch.manual_seed(0)
    model = Attention().eval()
    compiled = cache_compile(model.forward, cache_dir=cache)
    for i in range(6):
        x = torch.randn(5, 32)
        with torch.no_grad():
            want = model(x)
        torch.testing.assert_close(compiled(x), want, msg=f"call {i}")


def _set_bf16_cpu_matmul(on: bool) -> None:
    """The per-backend precision API alone; torch's legacy getter raises after it."""
    torch.backends.mkldnn.matmul.fp32_precision = "bf16" if on else "none"


@pytest.mark.parametrize("compiled_with", [False, True], ids=["loaded-with", "compiled-with"])
def test_bf16_cpu_matmul_set_per_backend_compiles_saves_and_loads(
    tmp_path: Path, compiled_with: bool
) -> None:
    """The entry's kernel decisions are exported with the environment after its first call,
    and compared with this environment before a loaded entry's first call."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", CacheWarning)
            _set_bf16_cpu_matmul(compiled_with)
            _serve(tmp_path / "cache")
            _set_bf16_cpu_matmul(True)
            _serve(tmp_path / "cache")
    finally:
        _set_bf16_cpu_matmul(False)
    assert counters["npugraph_ex_cache"]["compiled"] == 1
    assert counters["npugraph_ex_cache"]["loaded"] == 1
    assert sum(v for k, v in counters["npugraph_ex"].items() if k.startswith("captured")) >= 2


def test_torchs_autograd_cache_off_serves_without_the_disk_cache_naming_the_setting(
    tmp_path: Path,
) -> None:
    """AOTAutograd hands out a savable function only through its own cache."""
    import torch._functorch.config as functorch_config

    with functorch_config.patch(enable_autograd_cache=False), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CacheWarning)
        _serve(tmp_path / "cache")
    [warning] = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    assert "enable_autograd_cache is off" in warning and "without the disk cache" in warning
    assert sum(v for k, v in counters["npugraph_ex"].items() if k.startswith("captured")) >= 1


_FULL_DISK = """
import json, resource, sys, warnings
resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))  # writes past 2 kB fail (EFBIG)
import torch
from npugraph_ex.inference import cache_compile
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU()).eval()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    served = cache_compile(model.forward, cache_dir=sys.argv[1])
    for _ in range(6):
        x = torch.randn(4, 32)
        with torch.no_grad():
            torch.testing.assert_close(served(x), model(x))
print(json.dumps([str(w.message) for w in caught if "npugraph_ex cache" in str(w.message)]))
"""


def test_a_full_disk_serves_without_the_disk_cache_with_one_warning(tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "ind"))
    done = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path / "cache")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    [warning] = json.loads(done.stdout.strip().splitlines()[-1])
    assert "File too large" in warning and "without the disk cache" in warning


_WARM_DEBUG = """
import importlib, pathlib, sys, torch
torch.set_num_threads(int(sys.argv[3]))  # as the compiling process: part of the key
sys.path[:0] = [sys.argv[2], str(pathlib.Path(sys.argv[2]).parent)]
# the module under the name pytest gave it (the class's module is part of the key)
importlib.import_module(sys.argv[4])._serve(pathlib.Path(sys.argv[1]))
from torch._dynamo.utils import counters
assert counters["npugraph_ex_cache"][sys.argv[5]] == 1, dict(counters["npugraph_ex_cache"])
"""


def test_a_warm_start_under_torch_compile_debug_dumps_the_loaded_graph_and_its_captures(
    tmp_path: Path,
) -> None:
    """TORCH_COMPILE_DEBUG=1 on a warm start wrote no npugraph_ex folder at all (nothing was
    compiled); now the loaded graph's output code, its captures and a note of why there are no
    dynamo or pass dumps."""
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("TORCH_COMPILE_DEBUG_DIR", None)
    # both processes fresh: this one's global state (numerics flags other tests set) is part
    # of the key, so an entry compiled here need not be the one a fresh process loads
    for debug, counted in (("0", "compiled"), ("1", "loaded")):
        done = subprocess.run([sys.executable, "-c", _WARM_DEBUG, str(tmp_path / "cache"),
                               str(Path(__file__).parent), str(torch.get_num_threads()),
                               Attention.__module__, counted],
                              cwd=tmp_path, env={**env, "TORCH_COMPILE_DEBUG": debug},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
    [model] = tmp_path.glob("torch_compile_debug/run_*/npugraph_ex/model__*")
    assert "loaded from a saved compile" in (model / "loaded.txt").read_text()
    assert "def forward" in (model / "forward" / "output_code.py").read_text()
    [capture] = model.glob("graph_*.json")
    assert '"reason": "new_key"' in capture.read_text()
    assert not (model / "dynamo_out_graph.txt").exists()


def test_the_npugraph_ex_log_names_the_entry_each_miss_compiled_or_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="npugraph_ex")
    _serve(tmp_path / "cache")
    _serve(tmp_path / "cache")
    torch.use_deterministic_algorithms(True)  # global state the entry's guards check
    try:
        _serve(tmp_path / "cache")
    finally:
        torch.use_deterministic_algorithms(False)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cache: ")]
    assert [s.split()[2] for s in said] == ["compiled", "loaded", "its", "compiled"], said
    assert said[0].split()[-1] == said[1].split()[-1]  # one entry, its path
    assert said[0].split()[-1].endswith(".ngx")
    assert said[2].startswith(f"cache: {said[0].split()[-1]}: its guards reject this call")

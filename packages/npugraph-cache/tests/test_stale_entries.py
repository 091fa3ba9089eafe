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


def _serve(layer: torch.nn.Module, cache: Path, **kwargs: Any) -> list[str]:
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
            torch.testing.assert_close(compiled(x), want, msg=f"call {i}")
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


_RANK_WORKER = '''
import datetime, json, os, sys
import torch, torch.distributed as dist
from npugraph_cache import cache_compile
from torch._dynamo.utils import counters


class Scaled(torch.nn.Module):
    """Wraps its method in __init__, as the seed's example does: built before the group."""

    def __init__(self, cache):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.served = cache_compile(self.forward, cache_dir=cache)

    def forward(self, x):
        return self.lin(x) * (dist.get_rank() + 1)  # the traced graph holds this rank


rank, port, cache = int(sys.argv[1]), sys.argv[2], sys.argv[3]
model = Scaled(cache).eval()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=30))
if rank == 0:
    dist.barrier()  # rank 1 compiles and saves first
errors = []
for i in range(6):
    x = torch.randn(3, 8)
    with torch.no_grad():
        errors.append(float((model.served(x) - model(x)).abs().max()))
if rank == 1:
    dist.barrier()
dist.barrier()
dist.destroy_process_group()
print(json.dumps({"errors": errors, "cache": dict(counters["npugraph_ex_cache"]),
                  "folder": model.served.entry_paths[0].parent.parent.name}))
'''


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ranks_built_before_the_process_group_get_entries_of_their_own(tmp_path: Path) -> None:
    """cache_compile before init_process_group: the rank is read when an entry is made, so
    rank 0 never loads rank 1's graph (which holds ``dist.get_rank()``)."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "rank_worker.py"
    script.write_text(_RANK_WORKER)
    port = str(_free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), port, str(tmp_path / "c")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    for rank, result in enumerate(results):
        assert result["errors"] == [0.0] * 6, result
        assert result["cache"].get("compiled") == 1 and not result["cache"].get("loaded"), result
        assert result["folder"] == f"world2global_rank{rank}"


def test_a_cache_folder_below_a_file_warns_and_serves_without_the_disk_cache(
    tmp_path: Path,
) -> None:
    (tmp_path / "a_file").write_text("")
    torch.manual_seed(0)
    [warning] = _serve(Layer(), tmp_path / "a_file" / "cache")
    assert "cannot use the cache folder" in warning and "NotADirectoryError" in warning
    assert "without the disk cache" in warning


def test_an_entry_that_cannot_be_written_warns_and_the_compiled_function_serves(
    tmp_path: Path,
) -> None:
    """A write that fails after compiling (here: a folder where the entry goes; a full disk
    the same) keeps the compiled function for this process, with one warning."""
    torch.manual_seed(0)
    probe = cache_compile(Layer().forward, cache_dir=tmp_path)
    probe.store.ensure_dir(probe.func_dir)
    key = probe.key_for((torch.randn(3, 8),), {})
    blocker = probe.store.entry_path(probe.func_dir, key.digest())
    (blocker / "x").mkdir(parents=True)
    torch.manual_seed(0)
    warned = _serve(Layer(), tmp_path)
    assert any("cannot be saved to" in w and "this process uses it" in w for w in warned), warned
    assert counters["npugraph_ex_cache"]["compiled"] == 1


class Flagged(torch.nn.Module):
    """A class attribute and an environment variable the forward reads (torch guards neither
    in a way a save keeps: ``dict(type(self).__dict__)['GAIN']``, and a type check of
    os.environ only)."""

    GAIN = 2.0

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import os

        return self.lin(x) * self.GAIN * float(os.environ.get("NPUGRAPH_TEST_SCALE", "1"))


def _serve_flagged(cache: Path) -> list[str]:
    torch.manual_seed(0)
    return _serve(Flagged(), cache)


def test_a_class_attribute_or_environment_variable_read_by_the_trace_selects_its_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NPUGRAPH_TEST_SCALE", "1")
    assert _serve_flagged(tmp_path) == []
    assert _serve_flagged(tmp_path) == []  # the same values: loaded
    assert counters["npugraph_ex_cache"]["loaded"] == 1
    monkeypatch.setattr(Flagged, "GAIN", 5.0)
    [warning] = _serve_flagged(tmp_path)
    assert "dict(type(self).__dict__)['GAIN'] is 5.0, was 2.0" in warning
    monkeypatch.setenv("NPUGRAPH_TEST_SCALE", "3")
    [warning] = _serve_flagged(tmp_path)
    assert "os.environ differs from when compiled in NPUGRAPH_TEST_SCALE" in warning
    assert counters["npugraph_ex_cache"]["compiled"] == 3
    assert counters["npugraph_ex_cache"]["loaded"] == 1


def test_a_misspelt_keyword_names_the_one_meant_among_every_allowed_keyword() -> None:
    from npugraph_cache import CacheArgumentError

    with pytest.raises(CacheArgumentError, match=r"'cache_dri' \(did you mean 'cache_dir'\?\); "
                       r"allowed: dynamic, cache_dir, .*pp_rank, options"):
        cache_compile(Layer().forward, cache_dri="x")


def test_a_changed_tuple_is_shown_by_its_items_in_the_warning() -> None:
    import types

    from npugraph_cache.guards import ValueGuards, describe

    guards = ValueGuards("self", ("self.sizes",), (describe((8, 8)),))
    message = guards.mismatch({}, (types.SimpleNamespace(sizes=(4, 12)),))
    assert message == "self.sizes is (4, 12), was (8, 8) when compiled"


def test_a_global_naming_a_c_function_is_kept_a_librarys_own_function_is_not() -> None:
    """``ACT = torch.tanh`` may differ in the next process; ``torch.relu`` itself is fixed by
    the versions in the key, and a kept global costs a check on every call."""
    from npugraph_cache.guards import ValueGuards

    assert ValueGuards.kept("BUILTIN_MATCH", "G['ACT']", ("self",), torch.tanh) == "G['ACT']"
    assert ValueGuards.kept("BUILTIN_MATCH", "self.act", ("self",), F.gelu) == "self.act"
    assert ValueGuards.kept("BUILTIN_MATCH", "G['torch'].relu", ("self",), torch.relu) is None


def _layers_sliding(layers: list[Any]) -> list[bool]:
    # a comprehension (a nested code object before Python 3.12) and a frozenset constant: the
    # shape of transformers' Cache.is_sliding, whose identity guard an entry of a model with a
    # cache carries
    return [getattr(layer, "kind", "") in {"sliding", "chunked"} for layer in layers]


def test_a_function_is_described_alike_in_another_process() -> None:
    # its description held the nested code object's address (and the frozenset's hash-seeded
    # order): a warm process rejected every entry guarding such a function and recompiled
    import os
    import subprocess
    import sys

    from npugraph_cache.guards import describe

    here = describe(_layers_sliding)
    script = ("import sys; sys.path[:0] = sys.argv[1:]; import test_stale_entries as t; "
              "from npugraph_cache.guards import describe; print(describe(t._layers_sliding)[3])")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    there = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent), *sys.path],
                           capture_output=True, text=True, env=env, timeout=120, check=True)
    assert here[0] == "function" and there.stdout.strip() == here[3]  # the code's digest

"""npugraph_ex.inference.cache_compile on the npugraph_ex backend: compile once, load in later
processes without dynamo, AOT or passes, never a wrong result."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from npugraph_cache import CacheTypeError, CacheWarning, _compat
from npugraph_cache.format import MAGIC
from npugraph_cache.secret import KEY_ENV
from npugraph_cache.store import CacheStore

from npugraph_ex.inference import cache_compile, readable_cache

WORKER = Path(__file__).with_name("test_cache_compile_worker.py")
RANK_WORKER = Path(__file__).with_name("cache_rank_worker.py")
# torch < 2.12 (2.11.0): no usable aot_compile, so cache_compile runs without the disk cache
pytestmark = pytest.mark.skipif(not _compat.has_aot_compile(),
                                reason=f"torch {torch.__version__}: no disk cache (no aot_compile)")


@pytest.fixture(autouse=True, scope="module")
def own_cache_key(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """This module's tests and their worker processes use a key of their own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, str(tmp_path_factory.mktemp("key") / "cache.key"))
        yield


@pytest.fixture(autouse=True)
def fresh_counters() -> Iterator[None]:
    from torch._dynamo.utils import counters

    counters.clear()
    yield
    counters.clear()


def _worker(cache_dir: Path, out: Path, cwd: Path | None = None) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(
        [sys.executable, str(WORKER), str(cache_dir), str(out)],
        env=env, check=True, timeout=240, cwd=cwd,
    )
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_seed_example_second_process_loads_without_dynamo_and_matches_eager(tmp_path: Path) -> None:
    first = _worker(tmp_path / "cache", tmp_path / "first.json")
    assert first["cache"] == {"compiled": 2} and first["max_error"] == 0.0
    second = _worker(tmp_path / "cache", tmp_path / "second.json")
    assert second["cache"] == {"loaded": 2}
    assert second["unique_graphs"] == 0  # dynamo traced no frame
    assert second["aot"] == {}  # AOT autograd did not run (no cache lookup, no compile)
    assert second["captures"] >= 2  # device graphs captured again in this process
    assert second["max_error"] == 0.0
    assert second["warnings"] == []


class Decoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x)) + kv

    def decode(self, x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return self.forward(x, kv)


@pytest.fixture
def decoder() -> Decoder:
    torch.manual_seed(0)
    return Decoder().eval()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)


def _eager(decoder: Decoder, *args: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return decoder.decode(*args)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def _garbage(path: Path) -> None:
    path.write_bytes(b"\x80\x04" + os.urandom(2000))


def _old_version(path: Path) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, len(MAGIC), 0)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _garbage, _old_version])
def test_damaged_entry_warns_once_and_results_stay_correct(
    tmp_path: Path, decoder: Decoder, damage: Callable[[Path], None]
) -> None:
    x, kv = _inputs()
    first = cache_compile(decoder.decode, cache_dir=tmp_path)
    first(x, kv)
    [path] = first.entry_paths
    damage(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = cache_compile(decoder.decode, cache_dir=tmp_path)
        for _ in range(3):  # warm-up, capture, replay
            torch.testing.assert_close(again(x, kv), _eager(decoder, x, kv))
    [message] = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    assert str(path) in message
    assert CacheStore.read(path) is not None  # rewritten whole


def test_options_change_the_entry_and_equal_options_load_it(
    tmp_path: Path, decoder: Decoder
) -> None:
    x, kv = _inputs()
    a = cache_compile(decoder.decode, cache_dir=tmp_path, options={"capture_limit": 4})
    b = cache_compile(decoder.decode, cache_dir=tmp_path, options={"capture_limit": 5})
    torch.testing.assert_close(a(x, kv), _eager(decoder, x, kv))
    torch.testing.assert_close(b(x, kv), _eager(decoder, x, kv))
    assert a.entry_paths != b.entry_paths
    from torch._dynamo.utils import counters

    c = cache_compile(decoder.decode, cache_dir=tmp_path, options={"capture_limit": 4})
    torch.testing.assert_close(c(x, kv), _eager(decoder, x, kv))
    assert c.entry_paths == a.entry_paths
    assert counters["npugraph_ex_cache"]["loaded"] == 1


def test_custom_decompositions_are_applied_and_keyed(tmp_path: Path, decoder: Decoder) -> None:
    def relu_as_clamp(x: torch.Tensor) -> torch.Tensor:
        return torch.clamp_min(x, 0.0)

    x, kv = _inputs()
    plain = cache_compile(decoder.decode, cache_dir=tmp_path)
    decomposed = cache_compile(
        decoder.decode,
        cache_dir=tmp_path,
        custom_decompositions={torch.ops.aten.relu.default: relu_as_clamp},
    )
    torch.testing.assert_close(decomposed(x, kv), _eager(decoder, x, kv))
    torch.testing.assert_close(plain(x, kv), _eager(decoder, x, kv))
    assert decomposed.entry_paths != plain.entry_paths
    text = readable_cache(decomposed.entry_paths[0], print_output=False)
    code = text.split("compiled graph code")[1]
    assert "clamp_min" in code and "relu" not in code


def test_readable_cache_shows_the_optimized_graph_and_options(
    tmp_path: Path, decoder: Decoder
) -> None:
    fn = cache_compile(decoder.decode, cache_dir=tmp_path, options={"capture_limit": 3})
    fn(*_inputs())
    out = tmp_path / "readable.txt"
    text = readable_cache(fn.entry_paths[0], print_output=False, file=out)
    assert "Decoder.decode" in text and "capture_limit=3" in text
    assert "torch.ops.aten.addmm" in text.split("compiled graph code")[1]
    assert out.read_text() == text and (out.stat().st_mode & 0o777) == 0o600


def test_unknown_keyword_and_uncacheable_options_are_value_errors(decoder: Decoder) -> None:
    with pytest.raises(ValueError, match="'config'"):
        cache_compile(decoder.decode, config=None)
    with pytest.raises(ValueError, match="capture_limit"):
        cache_compile(decoder.decode, options={"capture_limit": 0})
    import npugraph_runtime

    with pytest.raises(ValueError, match="use_graph_pool"):
        cache_compile(
            decoder.decode, options={"use_graph_pool": npugraph_runtime.graph_pool_handle("cpu")}
        )


def test_unsavable_graph_runs_uncached_with_one_warning(tmp_path: Path, decoder: Decoder) -> None:
    # npugraph_cache used directly with a compile_fn whose output cannot be saved (a live pool
    # in the options; npugraph_ex.inference.cache_compile refuses that option up front)
    import npugraph_runtime
    from npugraph_backend import npugraph_ex_backend
    from npugraph_cache import cache_compile as raw_cache_compile

    pool = npugraph_runtime.graph_pool_handle("cpu")

    def compile_fn(options: Any, decompositions: Any) -> Callable[..., Any]:
        def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            return npugraph_ex_backend(gm, example_inputs, options={"use_graph_pool": pool})

        return backend

    x, kv = _inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn = raw_cache_compile(decoder.decode, cache_dir=tmp_path, compile_fn=compile_fn)
        for _ in range(3):
            torch.testing.assert_close(fn(x, kv), _eager(decoder, x, kv))
    [message] = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    assert "cannot be saved" in message and "use_graph_pool" in message
    assert fn.entry_paths == []


def test_two_working_directories_share_one_entry(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = _worker(cache, tmp_path / "first.json", cwd=tmp_path / "a")
    assert first["cache"] == {"compiled": 2} and first["max_error"] == 0.0
    second = _worker(cache, tmp_path / "second.json", cwd=tmp_path / "b")
    assert second["cache"] == {"loaded": 2} and second["max_error"] == 0.0
    assert second["warnings"] == [] and second["unique_graphs"] == 0
    assert len(list(cache.rglob("compiled_*.ngx"))) == 2


def test_the_key_holds_dump_options_only_when_dumping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from npugraph_ex import CompilerConfig

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    hashes = {}
    for where in ("a", "b"):
        monkeypatch.chdir(tmp_path / where)
        hashes[where] = (CompilerConfig().hash(),
                         CompilerConfig(dump_tensor_data=True, data_dump_dir="./").hash())
    assert hashes["a"] == hashes["b"]  # "./" is resolved where the artefact runs
    off = CompilerConfig(data_dump_stage="original", data_dump_dir=str(tmp_path)).hash()
    assert off == CompilerConfig().hash()  # dumping off: the dump options change nothing
    on = CompilerConfig(dump_tensor_data=True, data_dump_dir=str(tmp_path)).hash()
    assert on != CompilerConfig(dump_tensor_data=True).hash()


def test_bad_decompositions_and_cache_dir_name_the_argument(decoder: Decoder) -> None:
    with pytest.raises(CacheTypeError, match="custom_decompositions key str 'notanop'"):
        cache_compile(decoder.decode, custom_decompositions={"notanop": 1})
    with pytest.raises(CacheTypeError, match=r"cache_dir must be a folder path .* got int 5"):
        cache_compile(decoder.decode, cache_dir=5)
    with pytest.raises(CacheTypeError, match=r"readable_cache: cache_bin .* got NoneType None"):
        readable_cache(None)  # type: ignore[arg-type]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_ranks_fill_their_folder_and_key_from_the_process_group(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    procs = [
        subprocess.Popen([sys.executable, str(RANK_WORKER), str(cache), str(tmp_path / f"{r}.json")],
                         env=dict(env, RANK=str(r)))
        for r in range(2)
    ]
    try:
        assert [p.wait(timeout=180) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank in range(2):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        assert result["max_error"] == 0.0 and result["captures"] >= 1
        assert result["cache"] == {"compiled": 1}
        [entry] = result["entries"]
        assert Path(entry).parent.parent.name == f"world2global_rank{rank}"
        data = CacheStore.read(Path(entry))
        assert data is not None and data.metadata["rank"] == f"world2global_rank{rank}"
        assert data.metadata["key"]["rank"] == f"world2global_rank{rank}"


def _fresh(decoder: Decoder) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)) for _ in range(5)]


def test_warm_start_reuses_the_kernel_decisions_its_entry_recorded(
    tmp_path: Path, decoder: Decoder
) -> None:
    import npugraph_runtime
    from npugraph_runtime.devices import cpu_kernels
    from torch._dynamo.utils import counters

    # Other captures of this process decided other signatures: the entry keeps only its own.
    other = torch.randn(3, 7)
    with npugraph_runtime.graph(g := npugraph_runtime.Graph("cpu")):
        torch.sinh(other)
    assert any(k.startswith("aten::sinh|") for k in cpu_kernels.kernel_decisions())
    first = cache_compile(decoder.decode, cache_dir=tmp_path)
    first(*_inputs())
    g.reset()
    [path] = first.entry_paths
    metadata, authenticated = CacheStore.read_metadata(path)
    stored = metadata["entry_data"]
    assert authenticated and stored["environment"] == cpu_kernels.environment()
    assert stored["decisions"] and not any(k.startswith("aten::sinh|") for k in stored["decisions"])
    assert stored["decisions"].items() <= cpu_kernels.kernel_decisions().items()
    # As a fresh process: nothing decided yet. The load seeds the entry's decisions, trusted
    # (authenticated, same environment): the warm capture runs no candidate again, and its
    # replays equal eager.
    cpu_kernels._DECIDED.clear()
    cpu_kernels._SEEDED.clear()
    counters.clear()
    before = dict(cpu_kernels.DECISION_COUNTS)
    warm = cache_compile(decoder.decode, cache_dir=tmp_path)
    for args in _fresh(decoder):
        torch.testing.assert_close(warm(*args), _eager(decoder, *args))
    assert counters["npugraph_ex_cache"]["loaded"] == 1
    assert sum(v for k, v in counters["npugraph_ex"].items() if k.startswith("capture")) >= 1
    used = {k: cpu_kernels.DECISION_COUNTS[k] - before[k] for k in before}
    assert used["trusted"] > 0 and used["decided"] == 0 and used["rechecked"] == 0
    # the costs are the entry's (a fresh timing would give other nanoseconds), all seeds used
    assert cpu_kernels.kernel_decisions() == stored["decisions"] and cpu_kernels._SEEDED == {}


class Served(torch.nn.Module):
    """Four user inputs and parameters, as bench (a)'s graph, smaller."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))

    def step(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        h = a * b + c - d
        for layer in self.layers:
            h = torch.relu(layer(h))
        return h


def _served_inputs(
    n: int, shape: tuple[int, ...] = (8, 16), dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(n)
    return [[torch.randn(shape, generator=g).to(dtype=dtype, device=device) for _ in range(4)]
            for _ in range(n)]


def _matches_eager(fn: Any, model: Served, calls: list[list[torch.Tensor]]) -> None:
    for args in calls:
        with torch.no_grad():
            expected = model.step(*args)
        torch.testing.assert_close(fn(*args), expected, rtol=1e-5, atol=1e-6)


def _captures() -> int:
    from torch._dynamo.utils import counters

    return sum(v for k, v in counters["npugraph_ex"].items()
               if k.startswith(("capture_due", "recapture_due")))


def _serving(tmp_path: Path, start: str) -> tuple[Served, Any]:
    """A Served model and its cache_compile'd step (warm: loaded from an entry another call
    saved), after 5 calls compared with eager; counters count from the warm start on."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = Served().eval()
    if start == "warm":
        cache_compile(model.step, dynamic=False, cache_dir=tmp_path)(*_served_inputs(1)[0])
        counters.clear()
    fn = cache_compile(model.step, dynamic=False, cache_dir=tmp_path)
    _matches_eager(fn, model, _served_inputs(5))
    return model, fn


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_serving_path_catches_every_change_that_would_make_a_replay_wrong(
    tmp_path: Path, start: str
) -> None:
    """cache_compile keeps no per-call guard on parameters (the capture manager checks their
    addresses): each change below still gives a result equal to eager, over >= 5 calls."""
    from torch._dynamo.utils import counters

    model, fn = _serving(tmp_path, start)
    assert counters["npugraph_ex_cache"]["loaded" if start == "warm" else "compiled"] == 1
    assert _captures() >= 1
    # user-input shape and dtype: the kept guards reject the entry, another one is compiled
    _matches_eager(fn, model, _served_inputs(5, shape=(6, 16)))
    model.double()
    _matches_eager(fn, model, _served_inputs(5, dtype=torch.float64))
    model.float()
    assert counters["npugraph_ex_cache"]["compiled"] == (2 if start == "warm" else 3)
    # held outputs: a kept result keeps its values while later calls replay
    calls = _served_inputs(6)
    kept = fn(*calls[0])
    with torch.no_grad():
        kept_expected = model.step(*calls[0]).clone()
    _matches_eager(fn, model, calls[1:])
    torch.testing.assert_close(kept, kept_expected, rtol=1e-5, atol=1e-6)
    # a re-bound parameter (no frozen_parameter): a capture of its own, the new weight used
    before = _captures()
    model.layers[1].weight = torch.nn.Parameter(torch.randn(16, 16), requires_grad=False)
    _matches_eager(fn, model, _served_inputs(5))
    model.layers[2].bias.data = torch.randn(16)  # same Parameter, new storage
    _matches_eager(fn, model, _served_inputs(5))
    assert _captures() >= before + 2
    # a re-bound submodule
    model.layers[0] = torch.nn.Linear(16, 16)
    _matches_eager(fn, model, _served_inputs(5))
    # no recompile for either
    assert counters["npugraph_ex_cache"]["compiled"] == (2 if start == "warm" else 3)


class Cached(torch.nn.Module):
    """A decode step that updates a buffer in place (a KV cache's shape of problem)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.register_buffer("cache", torch.zeros(8, 16))

    def step(self, x: torch.Tensor) -> torch.Tensor:
        self.cache.mul_(0.5).add_(self.proj(x))
        return self.cache * 2.0 + x


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_serving_path_follows_a_mutated_buffer_and_its_re_binding(
    tmp_path: Path, start: str
) -> None:
    """AOT's wrapper applies the in-place update; a buffer re-bound by setattr (a new cache) is
    the one updated next. Compared with an eager twin over >= 5 calls."""
    import copy

    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = Cached().eval()
    twin = copy.deepcopy(model)
    if start == "warm":
        warm_up = copy.deepcopy(model)
        cache_compile(warm_up.step, dynamic=False, cache_dir=tmp_path)(torch.randn(8, 16))
        counters.clear()
    fn = cache_compile(model.step, dynamic=False, cache_dir=tmp_path)

    def same(n: int) -> None:
        for _ in range(n):
            x = torch.randn(8, 16)
            with torch.no_grad():
                expected = twin.step(x)
            torch.testing.assert_close(fn(x), expected, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(model.cache, twin.cache, rtol=1e-5, atol=1e-6)

    same(6)
    assert _captures() >= 1
    model.cache = torch.ones(8, 16)
    twin.cache = torch.ones(8, 16)
    same(6)


class AliasesInput(torch.nn.Module):
    """Returns a view of its input beside a computed tensor: AOT replays the alias after the
    graph."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def step(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.relu(self.proj(x)), x[1:]


class MutatesInput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def step(self, x: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        acc.add_(x)
        return self.proj(acc)


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_serving_path_replays_an_output_alias_and_an_argument_mutation(
    tmp_path: Path, start: str
) -> None:
    """An output that views an input stays a view of the caller's tensor, and an in-place update
    of an argument lands in the caller's tensor. Each compared with eager over >= 5 calls."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = AliasesInput().eval()
    if start == "warm":
        cache_compile(model.step, dynamic=False, cache_dir=tmp_path)(torch.randn(8, 16))
        counters.clear()
    fn = cache_compile(model.step, dynamic=False, cache_dir=tmp_path)
    for _ in range(6):
        x = torch.randn(8, 16)
        with torch.no_grad():
            want = model.step(x)
        got = fn(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert got[1].data_ptr() == x[1:].data_ptr()  # a view of the caller's tensor, as eager
    assert _captures() >= 1

    mutating = MutatesInput().eval()
    twin_fn = cache_compile(mutating.step, dynamic=False, cache_dir=tmp_path / "m")
    acc, twin_acc = torch.zeros(8, 16), torch.zeros(8, 16)
    for _ in range(6):
        x = torch.randn(8, 16)
        with torch.no_grad():
            want = mutating.step(x, twin_acc)
        torch.testing.assert_close(twin_fn(x, acc), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(acc, twin_acc)
    assert _captures() >= 2


class KV:
    """A request's cache, passed to each decode step (as transformers' StaticCache is)."""

    def __init__(self) -> None:
        self.k = torch.zeros(8, 16)


class TakesCache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def step(self, x: torch.Tensor, kv: KV) -> torch.Tensor:
        kv.k.mul_(0.5).add_(self.proj(x))
        return kv.k * 2.0 + x


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_serving_path_fetches_a_cache_arguments_tensors_on_every_call(
    tmp_path: Path, start: str
) -> None:
    """A cache object's tensors are taken from each call's argument (requests served in
    turn, then a new one): each request's cache is updated as eager updates it."""
    import copy

    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = TakesCache().eval()
    twin = copy.deepcopy(model)
    if start == "warm":
        cache_compile(model.step, dynamic=False, cache_dir=tmp_path)(torch.randn(8, 16), KV())
        counters.clear()
    fn = cache_compile(model.step, dynamic=False, cache_dir=tmp_path)
    ours, theirs = [KV(), KV()], [KV(), KV()]
    for n in range(8):
        if n == 6:
            ours[0], theirs[0] = KV(), KV()  # a new request in place of the first
        x = torch.randn(8, 16)
        with torch.no_grad():
            expected = twin.step(x, theirs[n % 2])
        torch.testing.assert_close(fn(x, ours[n % 2]), expected, rtol=1e-5, atol=1e-6)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a.k, b.k, rtol=1e-5, atol=1e-6)
    assert _captures() >= 2  # one capture per request's cache


class Slices(torch.nn.Module):
    """Slices its ModuleList inside the traced code, as transformers' models do: the slice
    builds a ModuleList, which runs torch's module registration hooks while dynamo traces."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))

    def step(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:2]:
            x = torch.relu(layer(x))
        return x


def test_the_registration_count_is_no_side_effect_of_traced_code(tmp_path: Path) -> None:
    """The registration hook npugraph_cache.registrations counts with is a no-op while dynamo
    traces: a graph that builds modules is served from one entry, and torch.compile does not
    recompile on every call."""
    from torch._dynamo.utils import counters

    model, other = Slices().eval(), Slices().eval()
    fn = cache_compile(model.step, dynamic=False, cache_dir=tmp_path)
    compiled = torch.compile(other.step, backend="npugraph_ex", dynamic=False)
    xs = [torch.randn(8, 16) for _ in range(5)]
    with torch.no_grad():  # eager first: its slicing builds modules, which the hook counts
        expected = [(model.step(x), other.step(x)) for x in xs]
        for x, (want, other_want) in zip(xs, expected, strict=True):
            torch.testing.assert_close(fn(x), want)
            torch.testing.assert_close(compiled(x), other_want)
    assert counters["npugraph_ex_cache"]["compiled"] == 1
    assert _captures() == 2  # one graph each, never recompiled (a recompile captures anew)


class SizeDependent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def step(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(a * b + a.shape[0])).reshape(-1)


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_serving_path_serves_a_dynamic_graph_with_the_sizes_of_each_call(
    tmp_path: Path, start: str
) -> None:
    """dynamic=True: the graph takes the batch size as an input, read by dynamo's bytecode from
    a call argument on each call, so every batch size replays its own
    capture of the one entry, equal to eager."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = SizeDependent().eval()
    if start == "warm":
        cache_compile(model.step, cache_dir=tmp_path)(torch.randn(8, 16), torch.randn(8, 16))
        counters.clear()
    fn = cache_compile(model.step, cache_dir=tmp_path)
    for n in (8, 8, 4, 4, 8, 3, 3, 5, 5, 8):
        a, b = torch.randn(n, 16), torch.randn(n, 16)
        with torch.no_grad():
            expected = model.step(a, b)
        torch.testing.assert_close(fn(a, b), expected)
    assert counters["npugraph_ex_cache"]["loaded" if start == "warm" else "compiled"] == 1
    assert _captures() == 4  # batch sizes 8, 4, 3, 5


_OFFSET = torch.ones(16)


class ReadsGlobal(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + _OFFSET


def test_serving_path_serves_a_graph_that_reads_a_global_tensor(tmp_path: Path) -> None:
    """A graph input that is neither a call argument nor the module's own tensor (here a module
    global), equal to eager."""
    model = ReadsGlobal().eval()
    fn = cache_compile(model.step, dynamic=False, cache_dir=tmp_path)
    for _ in range(5):
        x = torch.randn(8, 16)
        with torch.no_grad():
            torch.testing.assert_close(fn(x), model.step(x))
    assert _captures() >= 1


def test_direct_dispatch_is_refused_naming_its_removal(tmp_path: Path) -> None:
    from npugraph_cache import CacheArgumentError

    with pytest.raises(CacheArgumentError, match=r"direct_dispatch=False: the option was removed"):
        cache_compile(Served().step, cache_dir=tmp_path, direct_dispatch=False)


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_serving_path_refuses_a_parameter_re_bound_to_another_layout(
    tmp_path: Path, start: str
) -> None:
    """Without torch's per-parameter guards, a parameter re-bound to another shape or strides
    would replay a graph made for the old layout: the capture manager refuses it, naming the
    input, instead of returning a wrong number."""
    import npugraph_runtime as ngr

    torch.manual_seed(0)
    model = Served().eval()
    if start == "warm":
        cache_compile(model.step, dynamic=False, cache_dir=tmp_path)(*_served_inputs(1)[0])
    fn = cache_compile(model.step, dynamic=False, cache_dir=tmp_path)
    _matches_eager(fn, model, _served_inputs(5))
    assert _captures() >= 1
    model.layers[1].bias = torch.nn.Parameter(torch.randn(1), requires_grad=False)  # broadcasts
    with pytest.raises(ngr.PolicyError, match=r"re-bound to a tensor of shape \(1,\)"):
        fn(*_served_inputs(1)[0])
    model.layers[1].bias = torch.nn.Parameter(torch.randn(16), requires_grad=False)
    model.layers[0].weight = torch.nn.Parameter(torch.randn(16, 16).t(), requires_grad=False)
    with pytest.raises(ngr.PolicyError, match=r"stride \(1, 16\)"):
        fn(*_served_inputs(1)[0])
    # the same layout at a new address is a capture of its own, equal to eager
    model.layers[0].weight = torch.nn.Parameter(torch.randn(16, 16), requires_grad=False)
    _matches_eager(fn, model, _served_inputs(5))


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_serving_path_keeps_held_outputs_and_sees_a_data_swap(
    tmp_path: Path, start: str
) -> None:
    """A kept result keeps its values while later calls replay, and a ``.data`` swap of any
    parameter (here the last one) replays a capture with the new values: each equal to
    eager."""
    from torch._dynamo.utils import counters

    model, fn = _serving(tmp_path, start)
    calls = _served_inputs(7)
    kept = fn(*calls[0])
    with torch.no_grad():
        kept_expected = model.step(*calls[0]).clone()
    _matches_eager(fn, model, calls[1:])
    torch.testing.assert_close(kept, kept_expected, rtol=1e-5, atol=1e-6)
    del kept
    before = _captures()
    model.layers[-1].bias.data = torch.randn(16)
    _matches_eager(fn, model, _served_inputs(5))
    assert _captures() == before + 1
    assert counters["npugraph_ex_cache"]["compiled"] == (0 if start == "warm" else 1)


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_serving_path_entry_is_taken_only_when_the_guard_tree_passes(
    tmp_path: Path, start: str
) -> None:
    """An entry is called only after its whole guard tree passes: another stride, one
    tensor passed twice, and another global state (threads) are each refused, so another entry
    serves them; equal to eager."""
    from torch._dynamo.utils import counters

    model, fn = _serving(tmp_path, start)
    compiled = counters["npugraph_ex_cache"]["compiled"]
    transposed = [[torch.randn(16, 8).t() for _ in range(4)] for _ in range(5)]
    _matches_eager(fn, model, transposed)
    assert counters["npugraph_ex_cache"]["compiled"] == compiled + 1
    _matches_eager(fn, model, _served_inputs(3))
    x = torch.randn(8, 16)
    _matches_eager(fn, model, [[x, x, torch.randn(8, 16), torch.randn(8, 16)]] * 5)
    assert counters["npugraph_ex_cache"]["compiled"] == compiled + 2
    _matches_eager(fn, model, _served_inputs(3))
    assert counters["npugraph_ex_cache"]["compiled"] == compiled + 2  # the first entry again
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        _matches_eager(fn, model, _served_inputs(5))
    finally:
        torch.set_num_threads(threads)
    assert counters["npugraph_ex_cache"]["compiled"] == compiled + 3
    _matches_eager(fn, model, _served_inputs(5))  # the first entry again
    assert counters["npugraph_ex_cache"]["compiled"] == compiled + 3


def test_serving_path_serves_two_threads(tmp_path: Path) -> None:
    """Two threads on one entry: each result equals eager while the other thread's calls
    replay (a held result moves the other call to another capture)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = Served().eval()
    fn = cache_compile(model.step, dynamic=False, cache_dir=tmp_path)
    _matches_eager(fn, model, _served_inputs(3))

    def serve(n: int) -> None:
        for args in _served_inputs(n):
            got = fn(*args)
            with torch.no_grad():
                expected = model.step(*args)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)

    _in_threads(serve, (20, 21))
    assert counters["npugraph_ex_cache"]["compiled"] == 1


def _in_threads(work: Any, seeds: tuple[int, ...]) -> None:
    """``work(seed)`` in one thread per seed, all joined; the first failure is raised here."""
    import threading

    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            work(seed)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[0]


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_threads_making_the_first_calls_together_share_one_entry(tmp_path: Path, start: str) -> None:
    """Four threads call a fresh cache_compile function at once: one compiles (cold) or loads
    (warm) the entry, the others wait and use it, and every result equals eager."""
    import threading

    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = Served().eval()
    if start == "warm":
        _matches_eager(cache_compile(model.step, dynamic=False, cache_dir=tmp_path),
                       model, _served_inputs(2))
    before, captures = dict(counters["npugraph_ex_cache"]), _captures()
    fn = cache_compile(model.step, dynamic=False, cache_dir=tmp_path)
    barrier = threading.Barrier(4)

    def serve(n: int) -> None:
        barrier.wait(timeout=60)
        _matches_eager(fn, model, _served_inputs(n))

    _in_threads(serve, (4, 5, 6, 7))
    made = {k: counters["npugraph_ex_cache"][k] - before.get(k, 0) for k in ("compiled", "loaded")}
    assert made == ({"compiled": 1, "loaded": 0} if start == "cold" else {"compiled": 0, "loaded": 1})
    assert _captures() > captures  # replayed, not run eagerly


@pytest.mark.cuda
def test_serving_path_catches_a_user_input_on_another_device(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    model = Served().eval()
    fn = cache_compile(model.step, dynamic=False, cache_dir=tmp_path)
    _matches_eager(fn, model, _served_inputs(5))
    model.cuda()
    _matches_eager(fn, model, _served_inputs(5, device="cuda"))


# --- every Python value the traced code read is checked (issue 24) ------------------------------
_CASES_DIR = Path(__file__).parents[1] / "packages" / "npugraph-cache" / "tests"


def _serving_cases() -> Any:
    sys.path.insert(0, str(_CASES_DIR))
    try:
        import serving_cases
    finally:
        sys.path.remove(str(_CASES_DIR))
    return serving_cases


@pytest.mark.parametrize("case", sorted(_serving_cases().CASES))
def test_a_call_differing_in_a_python_value_the_code_read_matches_eager_on_captures(
    tmp_path: Path, case: str
) -> None:
    """The cache package's cases (serving_cases.py: argument objects, dtype/enum/function/
    partial/module arguments, floats in *args/**kwargs, dict key order, module attributes,
    submodules and hooks changed in the running process, globals) on the npugraph_ex backend:
    each call equal to eager, cold and then warm, through captured device graphs."""
    from torch._dynamo.utils import counters

    cases = _serving_cases()
    assert cases.run(case, str(tmp_path), cache_compile=cache_compile) == []
    assert counters["npugraph_ex_cache"]["compiled"] >= 1
    assert _captures() >= 1
    counters.clear()
    torch._dynamo.reset()
    assert cases.run(case, str(tmp_path), cache_compile=cache_compile) == []
    assert counters["npugraph_ex_cache"]["loaded"] >= 1
    assert _captures() >= 1

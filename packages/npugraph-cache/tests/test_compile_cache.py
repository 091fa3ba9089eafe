"""cache_compile: compile once, load in later processes, never a wrong result."""

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
from npugraph_cache import (
    CacheArgumentError,
    CachePermissionError,
    CacheTypeError,
    CacheWarning,
    EntryData,
    RngGraphError,
    _compat,
    cache_compile,
    readable_cache,
)
from npugraph_cache.cli import main as cli_main
from npugraph_cache.format import MAGIC, decode, encode
from npugraph_cache.store import CacheStore

WORKER = Path(__file__).with_name("cache_worker.py")
CASES_WORKER = Path(__file__).with_name("serving_cases.py")
VALUES_WORKER = Path(__file__).with_name("values_worker.py")
# torch < 2.12 (2.11.0): no usable aot_compile, so cache_compile runs without the disk cache
pytestmark = pytest.mark.skipif(not _compat.has_aot_compile(),
                                reason=f"torch {torch.__version__}: no disk cache (no aot_compile)")


class Block(torch.nn.Module):
    def __init__(self, random: bool = False) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.random = random

    def forward(self, x: torch.Tensor, kv: list[torch.Tensor]) -> torch.Tensor:
        h = torch.tanh(self.linear(x)) + kv[0]
        if self.random:
            h = h + torch.randn_like(h)
        return h

    def decode(self, x: torch.Tensor, kv: list[torch.Tensor]) -> torch.Tensor:
        return self.forward(x, kv)


@pytest.fixture
def block() -> Block:
    torch.manual_seed(0)
    return Block().eval()


def _inputs(seq: int = 4) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return torch.randn(seq, 8), [torch.randn(seq, 8)]


def _eager(block: Block, x: torch.Tensor, kv: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return block.decode(x, kv)


def _entry(fn: Any) -> Path:
    [path] = fn.entry_paths
    assert isinstance(path, Path)
    return path


@pytest.fixture
def cache_warnings() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def _ours(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]


def _run_worker(cache_dir: Path, out: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(WORKER), str(cache_dir), str(out)], env=env)


def _result(proc: subprocess.Popen[bytes], out: Path) -> dict[str, Any]:
    assert proc.wait(timeout=240) == 0
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_four_processes_at_once_compile_once_and_load_elsewhere(tmp_path: Path) -> None:
    procs = [
        (_run_worker(tmp_path / "c", tmp_path / f"{i}.json"), tmp_path / f"{i}.json")
        for i in range(4)
    ]
    results = [_result(p, out) for p, out in procs]
    assert all(r["max_error"] == 0.0 and r["warnings"] == [] for r in results)
    assert sum(r["cache"].get("compiled", 0) for r in results) == 2  # one compile per func
    assert sum(r["cache"].get("loaded", 0) for r in results) == 6
    # a process that loaded both methods traced no frame with dynamo
    assert all(r["unique_graphs"] == r["cache"].get("compiled", 0) for r in results)
    assert any(r["cache"] == {"loaded": 2} for r in results)
    for func in ("prompt", "decode"):
        [folder] = list((tmp_path / "c").glob(f"Model_dynamic_*/{func}"))
        entries = [p for p in folder.iterdir() if p.name != ".lock"]
        assert len(entries) == 1
        assert CacheStore.read(entries[0]) is not None


def _corrupt_truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt_garbage(path: Path) -> None:
    path.write_bytes(os.urandom(4096))


def _corrupt_old_version(path: Path) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, len(MAGIC), 0)
    path.write_bytes(bytes(data))


def _corrupt_payload(path: Path) -> None:
    # valid header and checksum around a payload torch cannot load
    # (written with the user's own key: an authentic entry torch cannot load)
    key = CacheStore().key
    entry = decode(path.read_bytes(), key)
    path.write_bytes(encode(entry.metadata, b"\x80\x04not a compiled function", key))


@pytest.mark.parametrize(
    "corrupt", [_corrupt_truncated, _corrupt_garbage, _corrupt_old_version, _corrupt_payload]
)
def test_broken_entry_warns_once_recompiles_and_matches_eager(
    tmp_path: Path,
    block: Block,
    corrupt: Callable[[Path], None],
    cache_warnings: list[warnings.WarningMessage],
) -> None:
    x, kv = _inputs()
    first = cache_compile(block.decode, cache_dir=tmp_path)
    first(x, kv)
    path = _entry(first)
    corrupt(path)
    os.chmod(path, 0o600)
    again = cache_compile(block.decode, cache_dir=tmp_path)
    torch.testing.assert_close(again(x, kv), _eager(block, x, kv))
    [message] = _ours(cache_warnings)
    assert str(path) in message and "recompiling" in message
    assert CacheStore.read(path) is not None  # rewritten whole


def test_guards_the_key_cannot_see_select_a_variant_of_the_entry(
    tmp_path: Path, block: Block, cache_warnings: list[warnings.WarningMessage]
) -> None:
    x, kv = _inputs()
    first = cache_compile(block.decode, cache_dir=tmp_path)
    first(x, kv)
    torch.use_deterministic_algorithms(True)  # global state dynamo guards on, not in the key
    try:
        again = cache_compile(block.decode, cache_dir=tmp_path)
        torch.testing.assert_close(again(x, kv), _eager(block, x, kv))
        [variant] = again.entry_paths
        assert variant != _entry(first) and variant.name.endswith("_1.ngx")
        third = cache_compile(block.decode, cache_dir=tmp_path)
        torch.testing.assert_close(third(x, kv), _eager(block, x, kv))
        assert third.entry_paths == [variant]  # loaded, not compiled again
    finally:
        torch.use_deterministic_algorithms(False)
    assert _ours(cache_warnings) == []


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def step(self, x: torch.Tensor, n: int, scale: float, flag: bool) -> torch.Tensor:
        for _ in range(n):
            x = self.linear(x)
        return x * scale if flag else x


def test_python_values_select_entries(
    tmp_path: Path, cache_warnings: list[warnings.WarningMessage]
) -> None:
    # the int is specialised by a guard (a variant), the bool by the key; the float is a graph
    # input (dynamic=True), so 2.0 and 3.0 share an entry
    module = Scaled().eval()
    fn = cache_compile(module.step, cache_dir=tmp_path)
    x = torch.randn(2, 4)
    for n, scale, flag in [(3, 2.0, True), (4, 2.0, True), (3, 3.0, True), (3, 2.0, False)]:
        with torch.no_grad():
            want = module.step(x, n, scale, flag)
        torch.testing.assert_close(fn(x, n, scale, flag), want)
    assert len(set(fn.entry_paths)) == 3
    assert all(p.exists() for p in fn.entry_paths) and _ours(cache_warnings) == []


def test_other_dtype_gives_another_entry(tmp_path: Path, block: Block) -> None:
    fn = cache_compile(block.decode, cache_dir=tmp_path)
    x, kv = _inputs()
    fn(x, kv)
    block64 = block.double()
    x64, kv64 = x.double(), [kv[0].double()]
    torch.testing.assert_close(fn(x64, kv64), _eager(block64, x64, kv64))
    assert len(set(fn.entry_paths)) == 2


def test_guard_check_says_which_calls_an_entry_serves_and_compiles_nothing(
    tmp_path: Path, block: Block
) -> None:
    from torch._dynamo.utils import counters

    counters.clear()
    fn = cache_compile(block.decode, cache_dir=tmp_path)
    x, kv = _inputs()
    assert not fn.guard_check(x, kv)  # no entry yet
    for _ in range(3):
        x, kv = _inputs()
        torch.testing.assert_close(fn(x, kv), _eager(block, x, kv))
    assert counters["npugraph_ex_cache"]["compiled"] == 1
    assert fn.guard_check(x, kv)
    assert fn.guard_check(*_inputs(6))  # dynamic: another length is the same entry
    assert not fn.guard_check(x.double(), [kv[0].double()])  # torch's tree: the dtype
    assert not fn.guard_check(x, [kv[0], kv[0]])  # the value signature: the list's length
    assert not fn.guard_check(x, kv=kv)  # a keyword is another signature: another entry
    with torch.enable_grad():
        assert fn.guard_check(x, kv)  # as the call: under no_grad
    assert counters["npugraph_ex_cache"]["compiled"] == 1 and len(fn.entry_paths) == 1
    torch.testing.assert_close(fn(x, kv=kv), _eager(block, x, kv))
    assert fn.guard_check(x, kv=kv) and counters["npugraph_ex_cache"]["compiled"] == 2


def test_graph_with_random_ops_is_refused(tmp_path: Path) -> None:
    fn = cache_compile(Block(random=True).decode, cache_dir=tmp_path)
    with pytest.raises(RngGraphError, match="random numbers"):
        fn(*_inputs())


def test_unknown_keyword_is_a_value_error_naming_it(block: Block) -> None:
    with pytest.raises(ValueError, match="'ge_cache'"):
        cache_compile(block.decode, ge_cache=True)


def test_plain_function_is_refused() -> None:
    with pytest.raises(ValueError, match=r"bound method of an nn\.Module"):
        cache_compile(lambda x: x)


def test_readable_cache_and_cli_show_the_graph_and_key(
    tmp_path: Path, block: Block, capsys: pytest.CaptureFixture[str]
) -> None:
    fn = cache_compile(block.decode, cache_dir=tmp_path / "c")
    fn(*_inputs())
    path = _entry(fn)
    text = readable_cache(path, print_output=False, file=tmp_path / "out.txt")
    assert "Block.decode" in text and "tanh" in text and "input spec" in text
    assert "forward_source" in text and "torch:" in text
    assert (tmp_path / "out.txt").read_text() == text
    assert cli_main(["show", str(path)]) == 0
    assert capsys.readouterr().out == text
    assert cli_main(["ls", str(tmp_path / "c")]) == 0
    assert "1 entry" in capsys.readouterr().out
    assert cli_main(["clear", str(tmp_path / "c")]) == 0
    assert not path.exists()


class Attention(torch.nn.Module):
    def __init__(self, dropout_p: float) -> None:
        super().__init__()
        self.dropout_p = dropout_p

    def step(self, q: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=self.dropout_p)


def test_attention_dropout_is_refused_only_when_it_draws(tmp_path: Path) -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RngGraphError, match="scaled_dot_product_attention"):
        cache_compile(Attention(0.5).step, cache_dir=tmp_path)(q)
    module = Attention(0.0)
    with torch.no_grad():
        want = module.step(q)
    torch.testing.assert_close(cache_compile(module.step, cache_dir=tmp_path)(q), want)


def test_ranks_get_their_own_folder(tmp_path: Path, block: Block) -> None:
    x, kv = _inputs()
    for rank in (0, 1):
        fn = cache_compile(block.decode, cache_dir=tmp_path, global_rank=rank, tp_rank=rank)
        torch.testing.assert_close(fn(x, kv), _eager(block, x, kv))
        [path] = fn.entry_paths
        assert path.parent.parent.name == f"world1global_rank{rank}_tp_rank{rank}"
        assert path.parent.name == "decode"


class _Evil:
    """A payload whose unpickling would run code: it must never be unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _forge_v1(metadata: dict[str, Any], payload: bytes) -> bytes:
    # the old format: an unkeyed sha256 anyone can recompute
    import hashlib
    import json as _json

    meta = _json.dumps(metadata, sort_keys=True).encode()
    header = struct.pack("<8sHIQ32s", MAGIC, 1, len(meta), len(payload),
                         hashlib.sha256(meta + payload).digest())
    return header + meta + payload


@pytest.mark.parametrize("forge", ["other_key", "old_format", "same_tag"])
def test_tampered_entry_never_unpickles_warns_once_and_recompiles(
    tmp_path: Path,
    block: Block,
    forge: str,
    cache_warnings: list[warnings.WarningMessage],
    capsys: pytest.CaptureFixture[str],
) -> None:
    import pickle

    x, kv = _inputs()
    first = cache_compile(block.decode, cache_dir=tmp_path / "c")
    first(x, kv)
    path = _entry(first)
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Evil(marker))
    original = path.read_bytes()
    entry = decode(original, CacheStore().key)
    if forge == "other_key":  # re-encoded by someone without this user's key
        data = encode(entry.metadata, evil, b"attacker-key".ljust(32, b"!"))
    elif forge == "old_format":
        data = _forge_v1(entry.metadata, evil)
    else:  # the genuine tag kept, the payload swapped for one of the same length
        evil = evil.ljust(len(entry.payload), b".")[: len(entry.payload)]
        data = original[: len(original) - len(entry.payload)] + evil
    path.write_bytes(data)
    os.chmod(path, 0o600)
    again = cache_compile(block.decode, cache_dir=tmp_path / "c")
    for _ in range(5):
        x, kv = _inputs()
        torch.testing.assert_close(again(x, kv), _eager(block, x, kv))
    [message] = _ours(cache_warnings)
    assert str(path) in message and "recompiling" in message
    assert not marker.exists()
    assert cli_main(["show", str(path)]) in (0, 1)  # shows metadata only, never the payload
    capsys.readouterr()
    assert not marker.exists()


def _one_entry(cache_dir: Path, block: Block) -> tuple[Path, Any]:
    fn = cache_compile(block.decode, cache_dir=cache_dir)
    fn(*_inputs())
    path = _entry(fn)
    return path, decode(path.read_bytes(), CacheStore().key)


def test_cli_show_says_when_an_entry_is_not_authenticated(
    tmp_path: Path, block: Block, capsys: pytest.CaptureFixture[str]
) -> None:
    path, entry = _one_entry(tmp_path, block)
    path.write_bytes(encode(entry.metadata, entry.payload, b"x" * 32))
    assert cli_main(["show", str(path)]) == 0
    assert "authenticated: NO" in capsys.readouterr().out


def test_show_escapes_control_characters_and_malformed_metadata_is_one_line(
    tmp_path: Path, block: Block, capsys: pytest.CaptureFixture[str]
) -> None:
    path, entry = _one_entry(tmp_path, block)
    key = CacheStore().key
    hostile = dict(entry.metadata, graph_code="x\x1b[2J\x1b]0;owned\x07y", func="\x1b[31mred")
    path.write_bytes(encode(hostile, entry.payload, key))
    assert cli_main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "x\\x1b[2J\\x1b]0;owned\\x07y" in out and "\\x1b[31mred" in out
    for bad in ({"key": [1, 2]}, {"key": {"environment": "x"}}, {"options": 5},
                {"value_guards": {"sources": 5}}):
        path.write_bytes(encode(dict(entry.metadata, **bad), entry.payload, key))
        assert cli_main(["show", str(path)]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "malformed metadata" in err and "Traceback" not in err


def _values_worker(cache_dir: Path, out: Path, **env: str) -> dict[str, Any]:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "SCALE": "2", "CELL": "5", "SHIFT": "1", **env}
    subprocess.run([sys.executable, str(VALUES_WORKER), str(cache_dir), str(out)], env=full,
                   check=True, timeout=240)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_changed_global_closure_cell_or_attribute_recompiles_with_one_warning(
    tmp_path: Path,
) -> None:
    cache, out = tmp_path / "c", tmp_path / "out.json"
    first = _values_worker(cache, out)
    assert first["cache"] == {"compiled": 1} and first["max_error"] == 0.0
    for env, source in (({"SCALE": "3"}, "G['SCALE'] is 3.0, was 2.0"),
                        ({"CELL": "7"}, "cell_contents is 7.0, was 5.0"),
                        ({"SHIFT": "4"}, "self.shift is 4.0, was 1.0")):
        changed = _values_worker(cache, out, **env)
        assert changed["max_error"] == 0.0  # the new value's result, not the cached one's
        [warning] = changed["warnings"]
        assert source in warning and "recompiling" in warning
        assert changed["cache"]["compiled"] == 1
    back = _values_worker(cache, out)  # the first values again: the first entry, loaded
    assert back["cache"] == {"loaded": 1} and back["warnings"] == []
    assert back["entries"] == first["entries"] and back["max_error"] == 0.0


def test_changed_global_within_a_process_selects_another_entry(tmp_path: Path) -> None:
    result = _values_worker(tmp_path / "c", tmp_path / "o.json", CHANGE_IN_PROCESS="1")
    assert result["max_error"] == 0.0 and len(result["entries"]) == 2
    [warning] = result["warnings"]
    assert "G['SCALE'] is 3.0, was 2.0" in warning


class Moded(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

    def step(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.inner:
            x = layer(x)
            x = x * 2 if layer.training else x - 1  # what dropout and BatchNorm do, in short
        return x


def test_a_submodules_training_flag_is_checked_on_every_call(tmp_path: Path) -> None:
    module = Moded().eval()
    fn = cache_compile(module.step, cache_dir=tmp_path)
    x = torch.randn(2, 4)
    for flip in (None, 1, 0, None, 0):
        if flip is not None:
            module.inner[flip].train(not module.inner[flip].training)
        with torch.no_grad():
            torch.testing.assert_close(fn(x), module.step(x))
    assert len(fn._entries) == 3  # (eval, eval), (eval, train), (train, train), then (eval, train)


def test_world_writable_cache_dir_is_refused(tmp_path: Path, block: Block) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(CachePermissionError, match=r"cache_dir .*mode 777"):
        cache_compile(block.decode, cache_dir=root)


def test_world_writable_func_folder_warns_and_bypasses_the_cache(
    tmp_path: Path, block: Block, cache_warnings: list[warnings.WarningMessage]
) -> None:
    x, kv = _inputs()
    first = cache_compile(block.decode, cache_dir=tmp_path)
    first(x, kv)
    folder = _entry(first).parent
    os.chmod(folder, 0o777)
    again = cache_compile(block.decode, cache_dir=tmp_path)
    torch.testing.assert_close(again(x, kv), _eager(block, x, kv))
    [message] = _ours(cache_warnings)
    assert "mode 777" in message and "without the disk cache" in message
    assert again.entry_paths == []


def test_planted_lock_symlink_warns_bypasses_and_never_creates_its_target(
    tmp_path: Path, block: Block, cache_warnings: list[warnings.WarningMessage]
) -> None:
    x, kv = _inputs()
    probe = cache_compile(block.decode, cache_dir=tmp_path)
    probe.store.ensure_dir(probe.func_dir)
    target = tmp_path / "victim"
    (probe.func_dir / ".lock").symlink_to(target)
    torch.testing.assert_close(probe(x, kv), _eager(block, x, kv))
    [message] = _ours(cache_warnings)
    assert "symbolic link" in message
    assert not target.exists()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"cache_dir": 5}, CacheTypeError, r"cache_dir must be a folder path .* got int 5"),
        ({"cache_dir": b"x"}, CacheTypeError, r"cache_dir .* got bytes"),
        ({"custom_decompositions": {"notanop": 1}}, CacheTypeError,
         r"custom_decompositions key str 'notanop' is not an ATen op; allowed keys"),
        ({"custom_decompositions": {torch.ops.aten.relu.default: 1}}, CacheTypeError,
         r"custom_decompositions\[aten.relu.default\] is int 1, not callable"),
        ({"custom_decompositions": [1]}, CacheTypeError, r"custom_decompositions must be a dict"),
        ({"dynamic": "yes"}, CacheArgumentError, r"dynamic must be True or False, got str 'yes'"),
    ],
)
def test_bad_arguments_raise_at_the_call_naming_them(
    block: Block, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        cache_compile(block.decode, **kwargs)


def test_cache_dir_that_is_a_file_is_refused_at_the_call(tmp_path: Path, block: Block) -> None:
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(CacheArgumentError, match=r"cache_dir '.*file' exists and is not a folder"):
        cache_compile(block.decode, cache_dir=path)


@pytest.mark.parametrize(("arg", "match"), [(None, "got NoneType None"), (5, "got int 5")])
def test_readable_cache_bad_argument_names_it(arg: Any, match: str) -> None:
    with pytest.raises(CacheTypeError, match=f"readable_cache: cache_bin must be .*{match}"):
        readable_cache(arg)


def test_entry_data_is_stored_after_the_first_call_and_seeded_on_load(
    tmp_path: Path, block: Block, cache_warnings: list[warnings.WarningMessage]
) -> None:
    seeded: list[Any] = []
    learned = {"decided": [["op", 12]]}
    data = EntryData(export=lambda: learned, seed=seeded.append)
    x, kv = _inputs()
    first = cache_compile(block.decode, cache_dir=tmp_path, entry_data=data)
    first(x, kv)
    metadata, authenticated = CacheStore.read_metadata(_entry(first))
    assert authenticated and metadata["entry_data"] == learned and seeded == []
    again = cache_compile(block.decode, cache_dir=tmp_path, entry_data=data)
    torch.testing.assert_close(again(x, kv), _eager(block, x, kv))
    assert seeded == [learned] and _ours(cache_warnings) == []

    def refuse(value: Any) -> None:
        raise ValueError(f"record {value!r} is malformed")

    bad = cache_compile(block.decode, cache_dir=tmp_path, entry_data=EntryData(lambda: {}, refuse))
    for _ in range(5):
        x, kv = _inputs()
        torch.testing.assert_close(bad(x, kv), _eager(block, x, kv))
    [message] = _ours(cache_warnings)
    assert "first-call data is ignored" in message and "malformed" in message


def test_keyword_calls_take_torchs_guard_check_and_stay_correct(tmp_path: Path, block: Block) -> None:
    fn = cache_compile(block.decode, cache_dir=tmp_path)
    for seq in (4, 4, 6, 6, 4):
        x, kv = _inputs(seq)
        torch.testing.assert_close(fn(x, kv=kv), _eager(block, x, kv))
        torch.testing.assert_close(fn(x, kv), _eager(block, x, kv))


# --- every Python value the traced code read is checked (issue 24) ------------------------------
sys.path.insert(0, str(CASES_WORKER.parent))
import serving_cases  # noqa: E402 - the cases live beside this file (a worker imports them too)


@pytest.mark.parametrize("case", sorted(serving_cases.CASES))
def test_a_call_differing_in_a_python_value_the_code_read_matches_eager_cold_and_warm(
    tmp_path: Path, case: str
) -> None:
    """An argument object's attribute, a dtype, enum, function, partial, module or callable
    argument, floats in ``*args``/``**kwargs``, a dict's key order, a ModuleList's length, a
    module attribute, submodule or hook changed in the running process, a global rebound: the
    served method matches eager on every call (twice each), cold and then warm (a new
    cache_compile loading the entries from disk), as torch.compile does."""
    from torch._dynamo.utils import counters

    counters.clear()
    assert serving_cases.run(case, str(tmp_path)) == []
    assert counters["npugraph_ex_cache"]["compiled"] >= 1
    counters.clear()
    torch._dynamo.reset()
    assert serving_cases.run(case, str(tmp_path)) == []
    assert counters["npugraph_ex_cache"]["loaded"] >= 1


def test_python_values_are_checked_across_processes(tmp_path: Path) -> None:
    """A second process whose first calls use the other values (the calls in reverse order)
    loads the entries of the first and matches eager on every call of every case. Both are fresh
    processes: global state that earlier tests of a suite left in this one (torch's config, the
    default dtype) is in an entry's key, and would rightly make the second process compile."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    results = []
    for order in ("forward", "reversed"):
        done = subprocess.run([sys.executable, str(CASES_WORKER), str(tmp_path), "all", order],
                              env=env, capture_output=True, text=True, timeout=900, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    for result in results:
        assert {case: errors for case, errors in result["errors"].items() if errors} == {}
    assert results[0]["counters"]["compiled"] >= len(serving_cases.CASES)
    assert results[1]["counters"].get("loaded", 0) >= len(serving_cases.CASES)


def test_a_float_default_left_out_does_not_make_every_float_a_new_entry(tmp_path: Path) -> None:
    """``f(x)`` (the default ``t=1.0``) and then ``f(x, t=...)`` with new floats: one entry for
    the default and one for the keyword, whatever its value; each call equal to eager."""
    from torch._dynamo.utils import counters

    counters.clear()
    model = serving_cases.Sampler().eval()
    fn = cache_compile(model.default, cache_dir=tmp_path)
    for kwargs in ({}, {"t": 0.5}, {"t": 0.7}, {"t": 0.9}, {}):
        x = torch.randn(3, 6)
        with torch.no_grad():
            torch.testing.assert_close(fn(x, **kwargs), model.default(x, **kwargs))
    assert counters["npugraph_ex_cache"]["compiled"] == 2


def test_an_entry_runs_dynamos_function_only_once_its_own_check_is_off(
    tmp_path: Path, block: Block
) -> None:
    """The serving call skips torch's second guard check (ours ran first), never a check that
    is still on: a compiled function with its check on is called as is, and refuses a call its
    guards reject."""
    fn = cache_compile(block.decode, cache_dir=tmp_path)
    x, kv = _inputs()
    torch.testing.assert_close(fn(x, kv), _eager(block, x, kv))
    [entry] = fn._entries
    assert entry.run is entry.compiled.fn  # the check is off: cache_compile checked first
    checked = _compat.aot_compile(block.decode, (x, kv), {}, _eager_graph, True)
    assert _compat.checked_elsewhere(checked) is checked
    with pytest.raises(RuntimeError, match="GuardManager check failed"):
        _compat.checked_elsewhere(checked)(block, x.double(), [kv[0].double()])
    for _ in range(3):
        x, kv = _inputs()
        torch.testing.assert_close(fn(x, kv), _eager(block, x, kv))


def _eager_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    return _compat.eager_serializable(gm)


def test_the_drop_list_names_only_what_torch_cannot_save() -> None:
    """The identity guards dropped from torch's tree are exactly the kinds its save refuses."""
    from torch._dynamo.guards import CheckFunctionManager

    assert frozenset(
        CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES) == _compat.UNSAVABLE_GUARDS


def test_a_module_of_a_class_defined_in_a_function_is_served_and_its_type_checked(
    tmp_path: Path,
) -> None:
    """torch cannot save a type check on an instance of a class defined in a function: that
    guard is dropped from its tree and checked by the cache on every call (the type's identity,
    else its qualified name); the entry serves cold and warm, equal to eager."""
    from torch._dynamo.utils import counters

    class Local(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w

    counters.clear()
    model = Local().eval()
    for _ in range(2):  # cold, then warm from the entry on disk
        fn = cache_compile(model.forward, cache_dir=tmp_path)
        for _ in range(3):
            x = torch.randn(2, 4)
            torch.testing.assert_close(fn(x), model(x))
    assert counters["npugraph_ex_cache"]["compiled"] == 1
    assert counters["npugraph_ex_cache"]["loaded"] == 1

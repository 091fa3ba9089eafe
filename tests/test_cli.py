"""The `npugraph-ex` command: --help and --version answer without importing torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

HELP = [[], ["demo", "--help"], ["bench", "--help"], ["doctor", "--help"], ["cache", "--help"],
        ["cache", "ls", "--help"], ["cache", "show", "--help"], ["cache", "clear", "--help"]]


def _help_text(argv: list[str]) -> str:
    """``npugraph-ex *argv`` in a fresh interpreter: its output, which must end with torch still
    not imported (checked in sys.modules, not timed)."""
    script = ("import sys\nfrom npugraph_ex.cli import main\n"
              f"try:\n    rc = main({argv!r} or ['--help'])\nexcept SystemExit as exc:\n    rc = exc.code\n"
              "print('torch imported' if 'torch' in sys.modules else 'no torch')\nsys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "no torch", proc.stdout
    return proc.stdout


@pytest.mark.parametrize("argv", HELP, ids=lambda a: " ".join(a) or "top")
def test_every_help_answers_without_importing_torch(argv: list[str]) -> None:
    text = _help_text(argv)
    assert "usage: npugraph-ex" in text or "npugraph-ex COMMAND" in text


def test_demo_help_states_its_defaults() -> None:
    text = " ".join(_help_text(["demo", "--help"]).split())  # argparse wraps lines
    for default in ("(default: 32)", "(default: demo-results)", "(default: tiny)", "(default: 1,"):
        assert default in text


@pytest.mark.parametrize("command", ["ls", "show"])
def test_cache_ls_and_show_default_to_the_folder_cache_compile_uses(command: str) -> None:
    from npugraph_cache import DEFAULT_CACHE_DIR

    text = " ".join(_help_text(["cache", command, "--help"]).split())
    assert f"(default: {DEFAULT_CACHE_DIR}, the folder cache_compile uses)" in text
    assert "positional arguments: path an entry file" in text or "positional arguments: dir the" in text


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_do_not_import_torch(flag: str) -> None:
    script = ("import sys; from npugraph_ex.cli import main; rc = main([" + repr(flag) + "]); "
              "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "no torch"
    assert ("npugraph-ex COMMAND" if flag == "--help" else "npugraph-ex 0.1") in proc.stdout


def test_facade_names_still_resolve_on_first_use() -> None:
    import npugraph_ex

    assert npugraph_ex.validate_options({"capture_limit": 2}).capture_limit == 2
    assert npugraph_ex.CompilerConfig is npugraph_ex.validate_options(None).__class__
    assert callable(npugraph_ex.hf.compile_config)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        npugraph_ex.nope  # noqa: B018


class Scale(torch.nn.Module):
    """A module cache_compile can save (a module of its own: torch pickles it by reference)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * 2


@pytest.mark.skipif(sys.platform == "win32", reason="entries are checked for POSIX ownership")
def test_cache_ls_and_show_without_a_path_read_cache_compiles_default_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from npugraph_cache import _compat
    from npugraph_cache.secret import KEY_ENV

    from npugraph_ex.cli import main
    from npugraph_ex.inference import cache_compile

    if not _compat.has_aot_compile():
        pytest.skip(f"torch {torch.__version__}: no disk cache (no aot_compile)")
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "cache.key"))
    monkeypatch.chdir(tmp_path)
    layer = Scale().eval()
    with torch.no_grad():
        cache_compile(layer.forward)(torch.randn(2, 4))  # writes below the default folder
    capsys.readouterr()
    assert main(["cache", "ls"]) == 0
    listed = capsys.readouterr().out
    assert ".npugraph_ex_cache/" in listed and listed.rstrip().endswith("1 entry")
    assert main(["cache", "show"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("=== .npugraph_ex_cache/") and shown.rstrip().endswith("1 entry")
    assert main(["cache", "show", "--file", "out.txt"]) == 1  # --file needs one entry
    assert "--file 'out.txt'" in capsys.readouterr().err


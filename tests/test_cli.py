"""The `npugraph-ex` command: --help and --version answer without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest


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

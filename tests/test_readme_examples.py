"""Every Python block of the root README runs as written, each as a script in a fresh process
and a fresh folder, so the examples cannot rot. A block that prints a counter is also checked
against what its comment promises (the cache example: compiled on the first run, loaded on the
second)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def python_blocks() -> list[tuple[str, str]]:
    """(the heading above the block, the block's code), in README order."""
    text = README.read_text()
    blocks = []
    for match in BLOCK.finditer(text):
        headings = re.findall(r"^#+ (.+)$", text[: match.start()], re.M)
        blocks.append((headings[-1] if headings else "top", match.group(1)))
    return blocks


BLOCKS = python_blocks()


def run_block(code: str, cwd: Path) -> str:
    script = cwd / "readme_block.py"
    script.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"README block failed:\n{code}\n{proc.stdout}\n{proc.stderr}"
    assert "Failed to initialize NumPy" not in proc.stderr
    return proc.stdout


def test_readme_has_the_documented_examples() -> None:
    headings = [h for h, _ in BLOCKS]
    assert any(h.startswith("Quick start") for h in headings)
    assert any("generate" in h for h in headings)
    assert any(h.startswith("cache_compile") for h in headings)
    assert any(h == "Options" for h in headings)


@pytest.mark.parametrize("heading,code", BLOCKS, ids=[f"{i}-{h[:24]}" for i, (h, _) in
                                                       enumerate(BLOCKS)])
def test_readme_python_block_runs(heading: str, code: str, tmp_path: Path) -> None:
    out = run_block(code, tmp_path)
    if "cache_compile(" in code:
        assert out.splitlines()[-1] == "{'compiled': 2}"
        again = run_block(code, tmp_path)  # same folder: a later process loads the cache
        assert again.splitlines()[-1] == "{'loaded': 2}"

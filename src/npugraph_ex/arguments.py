"""The command-line options of `npugraph-ex demo` and `npugraph-ex bench`.

They live apart from the commands, which import torch at module level, so that the CLI parses
(and answers ``--help`` or a bad option) before anything imports torch. The description of each
command is its module's docstring, read from the source rather than by importing the module."""

from __future__ import annotations

import argparse
import ast
import importlib.util
from pathlib import Path


def _docstring(module: str) -> str | None:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None  # no source to read (a sourceless install): --help without the description
    return ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8")), clean=False)


def demo_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npugraph-ex demo", description=_docstring("npugraph_ex.demo"),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32, help="tokens to generate (default: %(default)s)")
    p.add_argument("--out", default="demo-results",
                   help="folder for demo.json and demo.png (default: %(default)s)")
    p.add_argument("--device", default=None,
                   help="cpu, cuda or npu, with an optional index such as cuda:1 (default: the "
                        "best present: cuda, then npu, else cpu)")
    p.add_argument("--size", choices=("tiny", "1b"), default="tiny",
                   help="model size: tiny or about 1B parameters (for a GPU) (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke test: 8 tokens, eager and npugraph_ex only (default: off)")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op CPU threads (default on the CPU: 1, for stable timings)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (default: shown)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks (gloo on 127.0.0.1, CPU) (default: %(default)s, "
                        "one process)")
    return p


def bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npugraph-ex bench", description=_docstring("npugraph_ex.bench"),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-results",
                   help="folder for bench.json and bench.png (default: %(default)s)")
    p.add_argument("--only", default="", help="comma-separated sections to run, e.g. a,c (default: all)")
    p.add_argument("--quick", action="store_true", help="a fast smoke run (fewer, smaller cases)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the best present)")
    p.add_argument("--runs", type=int, default=None, help="timed samples per figure (>= 20)")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op CPU threads (default on the CPU: 1, so that timings on a shared "
                        "machine are stable; elsewhere torch's default)")
    p.add_argument("--inductor-budget", type=float, default=300.0,
                   help="seconds after which an inductor compile is given up and noted (default 300)")
    p.add_argument("--clock", choices=("auto", "cpu", "wall"), default="auto",
                   help="what timings read: auto (default) = the thread's CPU time on a CPU run "
                        "with one thread (immune to other processes on the machine), else wall")
    p.add_argument("--budget", type=float, default=0.0,
                   help="seconds for the whole suite: sections (and compilers in (c)) not "
                        "started by then are skipped with a note (default: no limit)")
    p.add_argument("--decode-cases", default="",
                   help="(c) only these cases, comma-separated labels such as llama-medium-b8 "
                        "(default: all)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p

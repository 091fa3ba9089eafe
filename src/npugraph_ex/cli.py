"""The `npugraph-ex` command: doctor, demo, bench, cache.

`--help` (of every command) and `--version` must answer at once: nothing at module level here
(nor in the package's ``__init__``) imports torch, and each command parses its arguments with a
torch-free parser before it imports what it needs to run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

USAGE = """npugraph-ex COMMAND [options]

commands:
  doctor            torch, torch_npu and transformers versions, devices and their capabilities
  demo              greedy decoding of a small Llama: eager, aot_eager and npugraph_ex side by side
  bench             the benchmark suite (bench.json and bench.png)
  cache show|ls|clear  the compile cache (show PATH: an entry in readable form)

`npugraph-ex COMMAND --help` for a command's options."""


def _doctor(argv: Sequence[str]) -> int:
    argparse.ArgumentParser(prog="npugraph-ex doctor",
                            description="Versions, devices and capabilities.").parse_args(argv)
    from npugraph_runtime.doctor import doctor_report, format_doctor

    print(format_doctor(doctor_report()))
    return 0


def _demo(argv: Sequence[str]) -> int:
    from npugraph_ex.arguments import demo_parser

    demo_parser().parse_args(argv)  # --help and bad options answer before torch is imported
    from npugraph_ex.demo import main

    return main(argv)


def _bench(argv: Sequence[str]) -> int:
    from npugraph_ex.arguments import bench_parser

    bench_parser().parse_args(argv)  # --help and bad options answer before torch is imported
    from npugraph_ex.bench import main

    return main(argv)


def _cache(argv: Sequence[str]) -> int:
    from npugraph_cache.cli import main  # torch-free until a command needs it

    result = main(list(argv))
    return int(result or 0)


COMMANDS = {"doctor": _doctor, "demo": _demo, "bench": _bench, "cache": _cache}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from npugraph_ex.__about__ import __version__

        print(f"npugraph-ex {__version__}")
        return 0
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"npugraph-ex: unknown command {args[0]!r}; use one of {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    try:
        return command(args[1:])
    except ImportError as exc:
        print(f"npugraph-ex {args[0]}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

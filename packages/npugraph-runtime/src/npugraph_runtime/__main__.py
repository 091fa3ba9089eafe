"""``python -m npugraph_runtime doctor [--json]``: what this machine offers npugraph-ex."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from npugraph_runtime.doctor import doctor_report, format_doctor, report_json


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m npugraph_runtime")
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser(
        "doctor", help="torch, torch_npu and transformers versions, devices and capabilities"
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        report = doctor_report()
        print(report_json(report) if args.json else format_doctor(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

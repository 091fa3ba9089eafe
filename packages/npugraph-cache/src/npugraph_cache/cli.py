"""``npugraph-ex cache show PATH | ls DIR | clear DIR`` (dispatched here by the npugraph-ex CLI)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from npugraph_cache.errors import CacheEntryError
from npugraph_cache.readable import escape_controls, readable_cache
from npugraph_cache.store import CacheStore, clear, iter_entries


def _ls(root: Path) -> int:
    if not root.exists():
        print(f"{root}: no such cache folder", file=sys.stderr)
        return 1
    count = 0
    for path in iter_entries(root):
        count += 1
        try:
            meta, authenticated = CacheStore.read_metadata(path)  # never unpickles
        except CacheEntryError as exc:
            print(escape_controls(f"{path}  INVALID ({exc.reason})"))
            continue
        size = path.stat().st_size
        state = "" if authenticated else "  NOT AUTHENTICATED (not written with your key)"
        print(escape_controls(
            f"{path}  {meta.get('func')}  {meta.get('created')}  {size} bytes{state}"
        ))
    print(f"{count} entr{'y' if count == 1 else 'ies'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="npugraph-ex cache", description="Inspect or clear the compile cache."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser(
        "show", help="print an entry's graph code and metadata (same text as readable_cache)"
    )
    show.add_argument("path")
    show.add_argument("--file", default=None, help="also write the text to this file (0600)")
    ls = sub.add_parser("ls", help="list the entries below a folder")
    ls.add_argument("dir")
    clr = sub.add_parser("clear", help="delete every entry below a folder")
    clr.add_argument("dir")
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        if args.command == "show":
            readable_cache(args.path, print_output=True, file=args.file)
            return 0
        if args.command == "ls":
            return _ls(Path(args.dir))
        removed = clear(Path(args.dir))
        print(f"removed {removed} entr{'y' if removed == 1 else 'ies'} from {args.dir}")
        return 0
    except (ValueError, TypeError, OSError) as exc:
        message = " ".join(str(exc).split())  # one line, whatever the file held
        print(escape_controls(f"npugraph-ex cache {args.command}: {message}"), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

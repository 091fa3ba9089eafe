"""``npugraph-ex cache show [PATH] | ls [DIR] | clear DIR`` (dispatched here by the npugraph-ex
CLI). ``show`` and ``ls`` default to the folder ``cache_compile`` uses.

Only argparse and the torch-free store are imported before the arguments are parsed: ``--help``
answers at once; ``show`` imports the reader (which needs torch) when it runs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from npugraph_cache.errors import CacheArgumentError, CacheEntryError
from npugraph_cache.store import DEFAULT_CACHE_DIR, CacheStore, clear, iter_entries


def _ls(root: Path) -> int:
    from npugraph_cache.readable import escape_controls

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


def _show(path: Path, file: str | None) -> int:
    """One entry, or every entry below a folder (``--file`` only for one entry)."""
    from npugraph_cache.readable import readable_cache

    if not path.is_dir():
        readable_cache(path, print_output=True, file=file)
        return 0
    if file is not None:
        raise CacheArgumentError(f"--file {file!r} writes one entry's text: give PATH as an entry "
                                 f"file, not the folder {str(path)!r}")
    entries = list(iter_entries(path))
    for entry in entries:
        print(f"=== {entry}")
        readable_cache(entry, print_output=True)
    print(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}")
    return 0


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="npugraph-ex cache", description="Inspect or clear the compile cache."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser(
        "show", help="print an entry's graph code and metadata (same text as readable_cache)"
    )
    show.add_argument("path", nargs="?", default=DEFAULT_CACHE_DIR,
                      help="an entry file, or a folder: every entry below it (default: "
                           "%(default)s, the folder cache_compile uses)")
    show.add_argument("--file", default=None,
                      help="also write the text to this file (0600; PATH must be an entry file)")
    ls = sub.add_parser("ls", help="list the entries below a folder")
    ls.add_argument("dir", nargs="?", default=DEFAULT_CACHE_DIR,
                    help="the cache folder (default: %(default)s, the folder cache_compile uses)")
    clr = sub.add_parser("clear", help="delete every entry below a folder")
    clr.add_argument("dir", help="the cache folder to clear (no default: name it, e.g. "
                                 f"{DEFAULT_CACHE_DIR})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(list(argv) if argv is not None else None)
    try:
        if args.command == "show":
            return _show(Path(args.path), args.file)
        if args.command == "ls":
            return _ls(Path(args.dir))
        removed = clear(Path(args.dir))
        print(f"removed {removed} entr{'y' if removed == 1 else 'ies'} from {args.dir}")
        return 0
    except (ValueError, TypeError, OSError) as exc:
        from npugraph_cache.readable import escape_controls

        message = " ".join(str(exc).split())  # one line, whatever the file held
        print(escape_controls(f"npugraph-ex cache {args.command}: {message}"), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

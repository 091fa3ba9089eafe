"""A digest of a function's code that is the same in every process that has the same code.

``repr(code.co_consts)`` is not: a nested code object (a comprehension, a lambda, an inner
function) shows its memory address, and a frozenset constant (``x in {"a", "b"}``) its
hash-seeded order, so two processes would describe one function differently and an entry whose
guard names it would never load in another process."""

from __future__ import annotations

import hashlib
import types


def _consts(consts: tuple[object, ...]) -> bytes:
    parts: list[bytes] = []
    for c in consts:
        if isinstance(c, types.CodeType):
            parts.append(b"code:" + c.co_name.encode() + b":" + _code_bytes(c))
        elif isinstance(c, frozenset):
            parts.append(b"frozenset:" + repr(sorted(c, key=repr)).encode())
        elif isinstance(c, tuple):
            parts.append(b"tuple:(" + _consts(c) + b")")
        else:
            parts.append(repr(c).encode())
    return b"|".join(parts)


def _code_bytes(code: types.CodeType) -> bytes:
    return code.co_code + b"#" + _consts(code.co_consts)


def code_digest(code: types.CodeType) -> str:
    """sha256 (hex) of ``code``'s bytecode and constants, nested code objects by their own."""
    return hashlib.sha256(_code_bytes(code)).hexdigest()

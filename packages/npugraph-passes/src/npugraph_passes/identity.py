"""Stable identities of passes, for cache keys.

An identity is the sha256 of what decides a pass's effect: its source (or bytecode when the
source cannot be read) and the names and values of the options it reads. The same pass with the
same options has the same identity in every process; editing the pass changes it.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import marshal
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _code_digest(code: types.CodeType, h: Any) -> None:
    h.update(code.co_code)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code_digest(const, h)
        else:
            try:
                h.update(marshal.dumps(const))
            except ValueError:
                h.update(repr(const).encode())
    h.update(repr(code.co_names).encode())


def source_digest(obj: object) -> str:
    """sha256 of the source of a function, class instance or module; bytecode when no source.

    Objects that know their own identity (``identity()`` or torch's ``uuid()`` of a
    CustomGraphPass) are asked for it instead.
    """
    for attr in ("identity", "uuid"):
        method = getattr(obj, attr, None)
        if callable(method) and not isinstance(obj, type):
            try:
                value = method()
            except TypeError:
                continue
            if value is not None:
                return hashlib.sha256(repr(value).encode()).hexdigest()
    target: Any = obj
    if not isinstance(obj, (types.FunctionType, types.MethodType, types.ModuleType, type)):
        target = type(obj)
    if isinstance(target, types.MethodType):
        target = target.__func__
    h = hashlib.sha256()
    if isinstance(target, types.FunctionType):
        _closure_digest(target, h)
    try:
        h.update(inspect.getsource(target).encode())
    except (OSError, TypeError):
        code = getattr(target, "__code__", None)
        if isinstance(code, types.CodeType):
            _code_digest(code, h)
        else:
            h.update(f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}".encode())
    return h.hexdigest()


@functools.cache
def package_digest() -> str:
    """sha256 of every source file of npugraph_passes: the identity of the built-in passes
    changes when any of them, or a helper they share, changes."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


_SIMPLE = (int, float, str, bool, bytes, type(None))


def _closure_digest(fn: types.FunctionType, h: Any) -> None:
    """Values a function closes over or defaults to decide what it does, so they are hashed
    (simple values by value, anything else by type)."""
    values: list[object] = list(fn.__defaults__ or ())
    values += list((fn.__kwdefaults__ or {}).items())
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            values.append("<empty>")
    for value in values:
        if isinstance(value, _SIMPLE) or (
            isinstance(value, tuple) and all(isinstance(v, _SIMPLE) for v in value)
        ):
            h.update(repr(value).encode())
        elif isinstance(value, types.FunctionType):
            h.update(source_digest(value).encode())
        else:
            h.update(type(value).__qualname__.encode())


def options_digest(options: Mapping[str, object]) -> str:
    h = hashlib.sha256()
    for name in sorted(options):
        value = options[name]
        text = source_digest(value) if callable(value) else repr(value)
        h.update(f"{name}={text};".encode())
    return h.hexdigest()


def combine(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()

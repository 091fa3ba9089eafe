"""Stable identities of passes, for cache keys.

An identity is the sha256 of what decides a pass's effect: its source (or bytecode when the
source cannot be read) and the names and values of the options it reads. The same pass with the
same options has the same identity in every process; editing the pass changes it.
"""

from __future__ import annotations

import hashlib
import inspect
import marshal
import sys
import types
from collections.abc import Callable, Mapping
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
    try:
        h.update(inspect.getsource(target).encode())
    except (OSError, TypeError):
        code = getattr(target, "__code__", None)
        if isinstance(code, types.CodeType):
            _code_digest(code, h)
        else:
            h.update(f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}".encode())
    return h.hexdigest()


def module_digest(fn: Callable[..., object]) -> str:
    """sha256 of the whole module that defines ``fn``: a built-in pass changes when any helper
    of its module changes, not only its own body."""
    module = sys.modules.get(getattr(fn, "__module__", ""), None)
    if module is None:
        return source_digest(fn)
    return source_digest(module)


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

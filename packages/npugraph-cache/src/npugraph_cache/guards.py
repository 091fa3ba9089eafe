"""What torch's saved guard tree cannot check, recorded per entry and checked by us.

At compile time the guard filter (``_compat.portable_guard_filter``) hands us every guard
dynamo made; those the drop-list (``_compat.dropped_guard``, docs/serving.md) takes out of
torch's tree are recorded here as source expressions over ``G`` (the function's globals) and the
method's parameters (the module first), with a portable description of the value (type and
value for scalars, strings and tuples of them; module, qualified name and code digest for a
function; ``repr`` otherwise):

* the globals and closure cells (a loaded function would check a copy of them), the identities
  torch cannot save (which function, class, enum member or object a source holds), checked on
  every call against the live objects;
* the modules' ``training`` flags and hooks dicts, checked on every call (the hooks only after a
  hook was registered anywhere in the process);
* stream labels, and the torch streams and events the code read (their type, and their
  identity as a label), checked on every call as their aliasing pattern (``aliasing``);
* the value guards on the module and the arguments torch keeps too, recorded for the check before
  an entry is unpickled (a warning naming the value, another variant or a recompile) and after
  its first call; torch's tree checks them on every call, module attributes changed in a running
  process included.

A value whose description holds a memory address (``<object at 0x...>``) matches only in the
process that compiled it (documented in the README).
"""

from __future__ import annotations

import ast
import builtins
import enum
import hashlib
import operator
import os
import re
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from npugraph_cache import _compat, registrations
from npugraph_cache.code_digest import code_digest
from npugraph_cache.errors import FormatError

# value guards torch keeps, recorded too for the check before an entry is unpickled (a warning
# naming the value) and after its first call; BUILTIN_MATCH: a C function (``self.act = F.gelu``)
VALUE_GUARDS = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH", "BUILTIN_MATCH"})
# the identities torch cannot save (which function, class, enum member or object a name holds)
IDENTITY_GUARDS = _compat.UNSAVABLE_GUARDS
_MAX_DEPTH = 8
# modules and builtins dicts dynamo itself puts into the globals while tracing (absent in a
# process that loads)
_DYNAMO_IMPORTS = ("['__import_", "['__builtins_dict_")
_ENVIRON = "__import__('os').environ"
_BARE_GLOBAL = re.compile(r"G\['[^']+'\]\Z")
_SCALARS = frozenset({"NoneType", "bool", "int", "float", "str"})


def describe(value: Any, depth: int = 0) -> Any:
    """A portable, comparable description of a value (tuples, so it compares and hashes)."""
    if value is os.environ:  # names, and digests of the values (an entry is not encrypted)
        return ("environ", tuple(sorted(
            (k, hashlib.sha256(v.encode("utf-8", "surrogateescape")).hexdigest()[:16])
            for k, v in os.environ.items())))
    if isinstance(value, enum.Enum):  # before int: an IntEnum member is its own value
        return ("enum", type(value).__module__, type(value).__qualname__, value.name)
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return (type(value).__name__, value if not isinstance(value, bytes) else value.hex())
    if isinstance(value, tuple | list | frozenset | set) and depth < _MAX_DEPTH:
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return (type(value).__name__, tuple(describe(v, depth + 1) for v in items))
    qualname = getattr(value, "__qualname__", None)
    if callable(value) and isinstance(qualname, str):
        # the code too: two lambdas (or two closures of one factory) share a qualified name
        code = getattr(value, "__code__", None)
        digest = "" if not isinstance(code, types.CodeType) else code_digest(code)[:16]
        return ("function", str(getattr(value, "__module__", "")), qualname, digest)
    return ("repr", repr(value))


def _names(source: str) -> set[str] | None:
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError:
        return None
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def _rooted(name: str, params: Sequence[str]) -> bool:
    """Whether a guard's source is an expression over the module's globals (``G``) and the
    method's parameters only (``self.eps``, ``p.temperature``, ``type(fn).__call__``), without
    the globals dynamo itself adds while tracing."""
    if any(part in name for part in _DYNAMO_IMPORTS):
        return False
    names = _names(name)
    if names is None:
        return False
    return bool(names & {"G", *params}) and names <= {"G", *params, *dir(builtins)}


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_from_json(v) for v in value)
    return value


Frame = tuple[Any, ...]  # the method's parameters' values for one call, the module first


@dataclass(frozen=True)
class ValueGuards:
    """``sources`` are Python expressions over ``G`` (the function's globals) and the method's
    parameters ``params`` (the module first); ``expected`` the description of each value at
    compile time; ``every_call`` which of them this package checks on every call (those rooted
    at the globals and the identity guards: what torch's saved guard tree does not check;
    the others torch checks on every call and are here for the checks before an entry is
    unpickled and after its first call)."""

    self_name: str
    sources: tuple[str, ...]
    expected: tuple[Any, ...]
    params: tuple[str, ...] = ()
    every_call: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if not self.params:
            object.__setattr__(self, "params", (self.self_name,))
        if len(self.every_call) != len(self.sources):
            object.__setattr__(self, "every_call", tuple(
                s.startswith("G[") or s == _ENVIRON for s in self.sources))

    @staticmethod
    def kept(guard_type: str, name: str, params: Sequence[str], value: Any = None) -> str | None:
        """The source to record for one of dynamo's guards, or None. Recorded: every guard
        rooted at the globals (torch would check a copy of them made when the entry was
        compiled or loaded: ``GLOBALS``), every identity guard (torch cannot save them:
        ``IDENTITY_GUARDS``), and the value guards on the module and the arguments (checked
        before an entry is unpickled and after its first call; torch checks them on every
        call). ``params``: the method's parameter names, the module's first. ``os.environ``
        read by the traced code (``os.environ.get("FLAG")``) has no guard on its values in
        torch (a type check only): that check is kept as one on the whole environment
        (however the code imported os), so a process started with other variables does not
        load the entry."""
        if guard_type == "TYPE_MATCH" and value is os.environ:
            return _ENVIRON
        if guard_type == _compat.STREAM_LABEL:  # checked as the streams' aliasing pattern
            return name if _rooted(name, params) else None
        if guard_type == "EMPTY_NN_MODULE_HOOKS_DICT":  # re-checked after a hook registration
            return f"len({name})" if _rooted(name, params) else None
        rooted_at_globals = name.startswith("G[")
        if not (rooted_at_globals or guard_type in IDENTITY_GUARDS | VALUE_GUARDS):
            return None
        if (guard_type in IDENTITY_GUARDS or guard_type == "BUILTIN_MATCH") and (
                rooted_at_globals and not _BARE_GLOBAL.match(name)):
            # ``G['torch'].relu``: a library's own function, fixed by the versions in the key;
            # a global is checked on every call, so only ``ACT = torch.tanh`` itself is kept
            return None
        return name if _rooted(name, params) else None

    @classmethod
    def from_recorded(
        cls, recorded: Sequence[tuple[str, str]], params: Sequence[str],
        f_globals: dict[str, Any], frame: Frame,
    ) -> ValueGuards:
        """The recorded ``(guard kind, source)`` pairs that evaluate here, with the values they
        have now (right after tracing, the values dynamo specialised on)."""
        sources: list[str] = []
        expected: list[Any] = []
        every: list[bool] = []
        labels = [name for kind, name in dict.fromkeys(recorded) if kind == _compat.STREAM_LABEL]
        if labels:
            recorded = [(_ALIASING, f"{_ALIASING}({', '.join(labels)})")] + [
                (kind, name) for kind, name in recorded if kind != _compat.STREAM_LABEL]
        for kind, name in dict.fromkeys(recorded):
            if name in sources:
                if kind in IDENTITY_GUARDS:
                    every[sources.index(name)] = True
                continue
            try:
                value = _evaluator(params, (name,))(f_globals, *frame)[0]
            except Exception:  # an expression of dynamo's own helpers: not ours to evaluate
                continue
            sources.append(name)
            expected.append(value)
            every.append(name.startswith("G[") or name == _ENVIRON or kind in IDENTITY_GUARDS
                         or kind == _ALIASING)
        return cls(params[0], tuple(sources), tuple(expected), tuple(params), tuple(every))

    def _module_only(self, sources: Sequence[str]) -> bool:
        """``sources`` read nothing but the module, ``G`` and builtins: a call need not bind its
        frame to evaluate them."""
        return all((_names(s) or set()) <= {"G", self.self_name, *_KNOWN} for s in sources)

    def to_json(self) -> dict[str, Any]:
        return {"self": self.self_name, "params": list(self.params),
                "sources": list(self.sources), "expected": list(self.expected),
                "every_call": list(self.every_call)}

    @classmethod
    def from_json(cls, data: Any) -> ValueGuards:
        """FormatError when the metadata does not have the shape ``to_json`` writes."""
        if data is None:
            return cls("self", (), ())
        ok = (
            isinstance(data, dict)
            and isinstance(data.get("self"), str)
            and data["self"].isidentifier()
            and isinstance(data.get("params"), list)
            and all(isinstance(p, str) and p.isidentifier() for p in data["params"])
            and data["params"][:1] == [data["self"]]
            and isinstance(data.get("sources"), list)
            and isinstance(data.get("expected"), list)
            and isinstance(data.get("every_call"), list)
            and len(data["sources"]) == len(data["expected"]) == len(data["every_call"])
            and all(isinstance(s, str) for s in data["sources"])
            and all(isinstance(e, bool) for e in data["every_call"])
        )
        if not ok:
            raise FormatError("value_guards metadata is malformed")
        return cls(data["self"], tuple(data["sources"]), _from_json(data["expected"]),
                   tuple(data["params"]), tuple(data["every_call"]))

    def checker(
        self, f_globals: dict[str, Any], module: Any, bind: Callable[..., Frame],
    ) -> Callable[[tuple[Any, ...], dict[str, Any]], bool]:
        """The check for every call ``check(args, kwargs)``: True when every value torch's saved
        guards do not check (``every_call``: the globals, and the identities of functions,
        classes and enum members the code read, on the module or an argument) and every
        module's ``training`` flag the code read still has its description. The fast path
        compares the raw values with those last seen to match (a tuple compare, identity
        first); only when that differs are the values described and compared. The
        arguments are bound to the method's parameters (``bind(args, kwargs)``) only where a
        checked source reads one."""
        flags = self._mode_check(module)
        hooks = self._hooks_check(f_globals, module, bind)
        modes = flags
        if hooks is not None:
            modes = hooks if flags is None else (
                lambda args, kwargs: hooks(args, kwargs) and flags(args, kwargs))
        picked = [i for i, every in enumerate(self.every_call) if every]
        if not picked:
            return modes or _always
        sources = [self.sources[i] for i in picked]
        module_only = self._module_only(sources)
        params = (self.self_name,) if module_only else self.params
        raw = _evaluator(params, sources, described=False)
        described = _evaluator(params, sources)
        expected = tuple(self.expected[i] for i in picked)
        seen: list[Any] = [None]
        frame = (module,)

        def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
            try:
                at = frame if module_only else bind(args, kwargs)
                values = raw(f_globals, *at)
                if values == seen[0]:
                    return True
                if described(f_globals, *at) != expected:
                    return False
            except Exception:  # a global or attribute that is gone: not the traced value
                return False
            seen[0] = values
            return True

        if modes is None:
            return check
        return lambda args, kwargs: check(args, kwargs) and modes(args, kwargs)

    def _mode_check(self, module: Any) -> Callable[[tuple[Any, ...], dict[str, Any]], bool] | None:
        """The ``training`` flags the code read (``if self.training``, BatchNorm, dropout),
        checked on every call: ``model.norm.train()`` or ``model.drop.eval()`` alone is an
        ordinary thing to do in a running process. Read from the module objects, which are
        looked up again only after a submodule assignment (the registration count of
        ``npugraph_cache.registrations``): walking each ``self._modules[...]`` chain costs ~0.7 µs a module, reading
        the flag ~0.07 µs."""
        picked = [i for i, source in enumerate(self.sources) if _is_mode(source, self.self_name)]
        if not picked:
            return None
        owners = _evaluator((self.self_name,),
                            [self.sources[i][: -len(_MODE)] for i in picked], described=False)
        want = tuple(self.expected[i][1] for i in picked)
        counted = registrations.count_registrations()
        held: list[Any] = [-1, ()]  # (registration count, the modules)

        def modes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
            count = registrations.registrations()
            if count != held[0] or not counted:
                try:
                    held[1] = owners({}, module)
                except Exception:  # a submodule that is gone: not the traced module
                    return False
                held[0] = count
            return tuple(map(_training, held[1])) == want

        return modes

    def _hooks_check(
        self, f_globals: dict[str, Any], module: Any, bind: Callable[..., Frame],
    ) -> Callable[[tuple[Any, ...], dict[str, Any]], bool] | None:
        """The hooks dicts that were empty when the entry was traced (the module's, its
        submodules', a module argument's), all evaluated again only when a hook was registered
        anywhere in the process since they last passed (``_compat.hook_registrations``): one
        integer compare a call otherwise."""
        picked = [i for i, source in enumerate(self.sources) if _is_hooks(source)]
        if not picked:
            return None
        sources = [self.sources[i] for i in picked]
        module_only = self._module_only(sources)
        params = (self.self_name,) if module_only else self.params
        lengths = _evaluator(params, sources, described=False)
        empty = (0,) * len(sources)
        held = [-1]

        def hooks(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
            count = _compat.hook_registrations()
            if count == held[0] and module_only:
                return True
            try:
                at = (module,) if module_only else bind(args, kwargs)
                if lengths(f_globals, *at) != empty:
                    return False
            except Exception:  # a submodule that is gone: not the traced module
                return False
            held[0] = count
            return True

        return hooks

    def mismatch(self, f_globals: dict[str, Any], frame: Frame) -> str | None:
        """The first value that differs, described for a warning; None when all match."""
        for source, want in zip(self.sources, self.expected, strict=True):
            try:
                got = _evaluator(self.params, (source,))(f_globals, *frame)[0]
            except Exception as exc:
                return f"{source} cannot be read now ({type(exc).__name__}), was {_show(want)}"
            if got != want and source.startswith(f"{_ALIASING}("):
                return _aliasing_changed(source, got, want)
            if got != want and got[0] == want[0] == "environ":
                differ = sorted(dict(set(got[1]) ^ set(want[1])))
                return f"os.environ differs from when compiled in {', '.join(differ[:3])}"
            if got != want:
                return f"{source} is {_show(got)}, was {_show(want)} when compiled"
        return None

    def changed(self, f_globals: dict[str, Any], frame: Frame) -> str | None:
        """``mismatch`` in one evaluation of every source when nothing differs (the common
        case, checked once after an entry's first call)."""
        if not self.sources:
            return None
        try:
            if _evaluator(self.params, self.sources)(f_globals, *frame) == self.expected:
                return None
        except Exception:  # mismatch names the value that cannot be read
            pass
        return self.mismatch(f_globals, frame)


# The streams a graph runs on are named by labels whose values differ in every process (they
# name a stream of the graph, not a stream of the process): what the graph's meaning depends on
# is which of them are one stream. The label guards are dropped from torch's tree
# (``_compat.dropped_guard``: "stream label") and this pattern is checked on every call instead.
_ALIASING = "___stream_aliasing"
_KNOWN = frozenset({*dir(builtins), _ALIASING})


def aliasing(*labels: Any) -> tuple[int, ...]:
    """Which of ``labels`` are one stream: each label's index of first occurrence, so
    ``(a, b, a)`` -> ``(0, 1, 0)`` whatever the values."""
    first: dict[Any, int] = {}
    return tuple(first.setdefault(label, i) for i, label in enumerate(labels))


def _aliasing_changed(source: str, got: Any, want: Any) -> str:
    names = [_stream_name(n.strip()) for n in source[len(_ALIASING) + 1:-1].split(",")]

    def groups(desc: Any) -> str:
        pattern = [d[1] for d in desc[1]]
        return ", ".join(
            "[" + " = ".join(n for n, p in zip(names, pattern, strict=True) if p == first) + "]"
            for first in sorted(set(pattern)))

    return (f"the streams the code used are {groups(got)}, were {groups(want)} when compiled "
            "([a = b]: one stream)")


def _stream_name(label: str) -> str:
    """The stream's source in an aliasing label: ``self.s0.label`` (an object with
    ``__graph_stream_label__``) or ``id(self.s0)`` (a torch stream or event)."""
    if label.startswith("id(") and label.endswith(")"):
        return label[3:-1]
    return label.rsplit(".", 1)[0]


_MODE = ".training"
_training = operator.attrgetter("training")


def _is_mode(source: str, self_name: str) -> bool:
    """A module's (or a submodule's) mode, as dynamo names its source."""
    return source.endswith(_MODE) and source.startswith(f"{self_name}.")


def _is_hooks(source: str) -> bool:
    return source.startswith("len(") and source.endswith("hooks)")


def _always(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return True


def shown_value(desc: Any) -> str:
    """A stored description (JSON, from a file someone may have written) as a warning shows it."""
    try:
        return _show(_from_json(desc))
    except (IndexError, KeyError, TypeError):
        return repr(desc)[:60]


def _show(desc: Any) -> str:
    if desc[0] == "function":
        return f"function {desc[1]}.{desc[2]}"
    if desc[0] == "enum":
        return f"{desc[2]}.{desc[3]}"
    if desc[0] == "environ":
        return f"os.environ with {len(desc[1])} variables"
    if desc[0] in ("tuple", "list", "set", "frozenset"):
        items = desc[1]
        if all(len(d) == 2 and d[0] in _SCALARS for d in items):  # (4, 12), not "tuple of 2"
            text = ", ".join(repr(d[1]) for d in items) + ("," if len(items) == 1 else "")
            brackets = {"tuple": "()", "list": "[]"}.get(desc[0], "{}")
            shown = f"{brackets[0]}{text}{brackets[1]}"
            if len(shown) <= 60:
                return shown
        return f"{desc[0]} of {len(items)}"
    return repr(desc[1])[:60]


def _evaluator(
    params: Sequence[str], sources: Sequence[str], described: bool = True
) -> Callable[..., Any]:
    """``lambda G, <params>: (describe(<source>), ...)`` compiled once (without ``describe``:
    the raw values)."""
    body = ", ".join(f"___describe({s})" if described else s for s in sources)
    code = compile(f"lambda G, {', '.join(params)}: ({body},)", "<npugraph_cache value guards>",
                   "eval")
    namespace = {"___describe": describe, _ALIASING: aliasing, "__builtins__": builtins}
    fn: Callable[..., Any] = eval(code, namespace)  # our own sources
    return fn

"""Value guards that survive a save: the globals, closure cells and non-tensor module attributes
the traced code read.

torch cannot save the guards dynamo puts on such values (they need the frame's globals), so an
entry would otherwise replay the value it was traced with: ``self.lin(x) * SCALE`` with another
``SCALE`` in a later process would return the old result. At compile time the guard filter
hands us every value guard dynamo made (``CONSTANT_MATCH``/``EQUALS_MATCH`` on a value,
``CLOSURE_MATCH``/``FUNCTION_MATCH`` on a function); we keep those rooted at the module's
globals (``G[...]``, closure cells included) or at the module itself (``self.<attr>``) as source
expressions with a portable description of the value (type and value for scalars, strings and
tuples of them; module and qualified name for a function; ``repr`` otherwise). They are stored in
the entry's (authenticated) metadata and checked before an entry is unpickled; the globals are
checked again on every call, as are the modules' ``training`` flags: a changed value selects or
compiles another entry, as torch.compile recompiles. Another module attribute changed inside a
running process after its first call is not re-checked (documented in the README).

Guards on the other arguments are left to the key's value signature; a value whose description
holds a memory address (``<object at 0x...>``) cannot be compared across processes and is
skipped (documented in the README).
"""

from __future__ import annotations

import ast
import builtins
import enum
import hashlib
import operator
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from npugraph_cache import dispatch
from npugraph_cache.errors import FormatError

VALUE_GUARDS = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH"})
# BUILTIN_MATCH: a C function (``self.act = F.gelu``, ``ACT = torch.tanh``); CLASS_MATCH: a class
FUNCTION_GUARDS = frozenset({"BUILTIN_MATCH", "CLASS_MATCH", "CLOSURE_MATCH", "FUNCTION_MATCH"})
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_MAX_DEPTH = 8
# modules and builtins dicts dynamo itself puts into the globals while tracing (absent in a
# process that loads)
_DYNAMO_IMPORTS = ("['__import_", "['__builtins_dict_")
_ENVIRON = "__import__('os').environ"
_IDENTITY_GUARDS = frozenset({"BUILTIN_MATCH", "CLASS_MATCH", "ID_MATCH"})
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
        return ("function", str(getattr(value, "__module__", "")), qualname)
    return ("repr", repr(value))


def _rooted(name: str, self_name: str) -> bool:
    """Whether a guard's source is an expression over the module's globals (``G``) and the
    module (``self.eps``, ``dict(type(self).__dict__)['SCALE']`` for a class attribute) only,
    without the globals dynamo itself adds while tracing."""
    if any(part in name for part in _DYNAMO_IMPORTS):
        return False
    try:
        tree = ast.parse(name, mode="eval")
    except SyntaxError:
        return False
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    return bool(names & {"G", self_name}) and names <= {"G", self_name, *dir(builtins)}


def _portable(desc: Any) -> bool:
    return not (desc[0] == "repr" and _ADDRESS.search(desc[1]))


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_from_json(v) for v in value)
    return value


@dataclass(frozen=True)
class ValueGuards:
    """``sources`` are Python expressions over ``G`` (the function's globals) and the method's
    first parameter (the module); ``expected`` the description of each value at compile time."""

    self_name: str
    sources: tuple[str, ...]
    expected: tuple[Any, ...]

    @staticmethod
    def kept(guard_type: str, name: str, self_name: str, value: Any = None) -> str | None:
        """The source to keep for one of dynamo's guards, or None. ``value``: the guarded
        value; an identity guard (ID_MATCH) is kept for an enum member (``self.kind =
        Kind.CAUSAL``), which is described portably by class and name. ``os.environ`` read by
        the traced code (``os.environ.get("FLAG")``) has no guard on its values in torch (a
        type check only): that check is kept as one on the whole environment (however the
        code imported os), so a process started with other variables does not load the
        entry."""
        if guard_type == "TYPE_MATCH" and value is os.environ:
            return _ENVIRON
        if guard_type == "ID_MATCH":
            if not isinstance(value, enum.Enum):
                return None
        elif guard_type not in VALUE_GUARDS | FUNCTION_GUARDS:
            return None
        if guard_type in _IDENTITY_GUARDS and name.startswith("G[") and not _BARE_GLOBAL.match(name):
            # ``G['torch'].relu``: a library's own function, fixed by the versions in the key;
            # a global is checked on every call, so only ``ACT = torch.tanh`` itself is kept
            return None
        return name if _rooted(name, self_name) else None

    @classmethod
    def from_recorded(
        cls, names: Sequence[str], self_name: str, f_globals: dict[str, Any], module: Any
    ) -> ValueGuards:
        """The recorded guard sources that evaluate here, with the values they have now (right
        after tracing, the values dynamo specialised on)."""
        sources: list[str] = []
        expected: list[Any] = []
        for name in dict.fromkeys(names):
            try:
                value = _evaluator(self_name, (name,))(f_globals, module)[0]
            except Exception:  # an expression of dynamo's own helpers: not ours to evaluate
                continue
            if _portable(value):
                sources.append(name)
                expected.append(value)
        return cls(self_name, tuple(sources), tuple(expected))

    def to_json(self) -> dict[str, Any]:
        return {"self": self.self_name, "sources": list(self.sources), "expected": list(self.expected)}

    @classmethod
    def from_json(cls, data: Any) -> ValueGuards:
        """FormatError when the metadata does not have the shape ``to_json`` writes."""
        if data is None:
            return cls("self", (), ())
        ok = (
            isinstance(data, dict)
            and isinstance(data.get("self"), str)
            and data["self"].isidentifier()
            and isinstance(data.get("sources"), list)
            and isinstance(data.get("expected"), list)
            and len(data["sources"]) == len(data["expected"])
            and all(isinstance(s, str) for s in data["sources"])
        )
        if not ok:
            raise FormatError("value_guards metadata is malformed")
        return cls(data["self"], tuple(data["sources"]), _from_json(data["expected"]))

    def checker(self, f_globals: dict[str, Any], module: Any) -> Callable[[], bool]:
        """A cheap check for every call: True when every global (and closure cell), and every
        module's ``training`` flag the code read, still has its description. Other module
        attributes are checked when an entry is selected (``mismatch``) but not on every call:
        they are one per layer (a 12-layer Llama has ~250) and would cost ~100 µs a call. The
        fast path compares the raw values with those last seen to match (a tuple compare,
        identity first); only when that differs are the values described and compared."""
        modes = self._mode_check(module)
        picked = [i for i, source in enumerate(self.sources) if source.startswith("G[")]
        if not picked:
            return modes or _always
        sources = [self.sources[i] for i in picked]
        raw = _evaluator(self.self_name, sources, described=False)
        described = _evaluator(self.self_name, sources)
        expected = tuple(self.expected[i] for i in picked)
        seen: list[Any] = [None]

        def check() -> bool:
            try:
                values = raw(f_globals, module)
                if values == seen[0]:
                    return True
                if described(f_globals, module) != expected:
                    return False
            except Exception:  # a global or attribute that is gone: not the traced value
                return False
            seen[0] = values
            return True

        if modes is None:
            return check
        return lambda: check() and modes()

    def _mode_check(self, module: Any) -> Callable[[], bool] | None:
        """The ``training`` flags the code read (``if self.training``, BatchNorm, dropout),
        checked on every call: ``model.norm.train()`` or ``model.drop.eval()`` alone is an
        ordinary thing to do in a running process. Read from the module objects, which are
        looked up again only after a submodule assignment (the registration count of
        ``dispatch``): walking each ``self._modules[...]`` chain costs ~0.7 µs a module, reading
        the flag ~0.07 µs."""
        picked = [i for i, source in enumerate(self.sources) if _is_mode(source, self.self_name)]
        if not picked:
            return None
        owners = _evaluator(self.self_name,
                            [self.sources[i][: -len(_MODE)] for i in picked], described=False)
        want = tuple(self.expected[i][1] for i in picked)
        counted = dispatch.count_registrations()
        held: list[Any] = [-1, ()]  # (registration count, the modules)

        def modes() -> bool:
            count = dispatch.registrations()
            if count != held[0] or not counted:
                try:
                    held[1] = owners({}, module)
                except Exception:  # a submodule that is gone: not the traced module
                    return False
                held[0] = count
            return tuple(map(_training, held[1])) == want

        return modes

    def mismatch(self, f_globals: dict[str, Any], module: Any) -> str | None:
        """The first value that differs, described for a warning; None when all match."""
        for source, want in zip(self.sources, self.expected, strict=True):
            try:
                got = _evaluator(self.self_name, (source,))(f_globals, module)[0]
            except Exception as exc:
                return f"{source} cannot be read now ({type(exc).__name__}), was {_show(want)}"
            if got != want and got[0] == want[0] == "environ":
                differ = sorted(dict(set(got[1]) ^ set(want[1])))
                return f"os.environ differs from when compiled in {', '.join(differ[:3])}"
            if got != want:
                return f"{source} is {_show(got)}, was {_show(want)} when compiled"
        return None

    def changed(self, f_globals: dict[str, Any], module: Any) -> str | None:
        """``mismatch`` in one evaluation of every source when nothing differs (the common
        case, checked once after an entry's first call)."""
        if not self.sources:
            return None
        try:
            if _evaluator(self.self_name, self.sources)(f_globals, module) == self.expected:
                return None
        except Exception:  # mismatch names the value that cannot be read
            pass
        return self.mismatch(f_globals, module)


_MODE = ".training"
_training = operator.attrgetter("training")


def _is_mode(source: str, self_name: str) -> bool:
    """A module's (or a submodule's) mode, as dynamo names its source."""
    return source.endswith(_MODE) and source.startswith(f"{self_name}.")


def _always() -> bool:
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
    self_name: str, sources: Sequence[str], described: bool = True
) -> Callable[[dict[str, Any], Any], Any]:
    """``lambda G, <self_name>: (describe(<source>), ...)`` compiled once (without
    ``describe``: the raw values)."""
    body = ", ".join(f"___describe({s})" if described else s for s in sources)
    code = compile(f"lambda G, {self_name}: ({body},)", "<npugraph_cache value guards>", "eval")
    namespace = {"___describe": describe, "__builtins__": builtins}
    fn: Callable[[dict[str, Any], Any], Any] = eval(code, namespace)  # our own sources
    return fn

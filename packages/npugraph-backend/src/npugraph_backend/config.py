"""CompilerConfig: every option of the backend, typed and validated on assignment.

A config is built fresh for every compile (``CompilerConfig.from_options``) and copied before
anything could change it, so options never leak from one compile to another."""

from __future__ import annotations

import difflib
import hashlib
import itertools
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from npugraph_passes.identity import source_digest
from npugraph_runtime import PoolHandle
from npugraph_runtime.devices.base import CAPTURE_ERROR_MODES, is_raw_pool_id


class OptionError(ValueError):
    """An option with a name, type or value that is not allowed. The message names the option,
    the value given and what is allowed."""


class PassOptionError(OptionError, TypeError):
    """A custom pass option that is neither a callable nor None (a TypeError and an OptionError)."""


def _describe(value: object) -> str:
    return f"{value!r} (type {type(value).__name__})"


@dataclass(frozen=True)
class _Option:
    name: str
    default: object
    allowed: str  # what the error message says is allowed
    check: Callable[[object], bool]
    error: type[OptionError] = OptionError
    normalise: Callable[[object], object] | None = None
    doc: str = ""

    def validate(self, value: object) -> object:
        if not self.check(value):
            raise self.error(
                f"option {self.name!r}: value {_describe(value)} is not allowed; allowed: {self.allowed}"
            )
        return value if self.normalise is None else self.normalise(value)


def _is_bool(v: object) -> bool:
    return type(v) is bool  # 0 and 1 are refused: they are not booleans


def _bool(name: str, default: bool, doc: str) -> _Option:
    return _Option(name, default, "True or False (a bool; 0 and 1 are not accepted)", _is_bool, doc=doc)


def _enum(name: str, default: str, values: tuple[str, ...], doc: str) -> _Option:
    return _Option(
        name, default, " | ".join(repr(v) for v in values),
        lambda v: isinstance(v, str) and v in values, doc=doc,
    )


def _is_pool(v: object) -> bool:
    # A device's own handle is the allocator's (int, int) pool id (CUDA/NPU).
    return v is None or isinstance(v, PoolHandle) or is_raw_pool_id(v)


def _is_existing_dir(v: object) -> bool:
    return isinstance(v, str | os.PathLike) and os.path.isdir(v)


_MAX_CAPTURE_LIMIT = 2**63 - 1  # the runtime keeps counts in int64

#: capture_sizes="auto": powers of two with the midpoints above 8 (a padded call computes at
#: most 1.5x its rows), up to 256; 14 sizes, so even two captures per size stay under the
#: default capture_limit.
AUTO_CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def _is_capture_sizes(v: object) -> bool:
    if v is None or v == "auto":
        return True
    if not isinstance(v, list | tuple) or not v:
        return False
    if not all(type(x) is int and x >= 1 for x in v):
        return False
    return all(a < b for a, b in itertools.pairwise(v))


def resolved_capture_sizes(config: CompilerConfig) -> tuple[int, ...] | None:
    """capture_sizes as sizes ("auto": AUTO_CAPTURE_SIZES)."""
    sizes = config.capture_sizes
    return AUTO_CAPTURE_SIZES if sizes == "auto" else sizes  # type: ignore[return-value]


def _capture_sizes(v: object) -> object:
    if v is None:
        return None
    return v if v == "auto" else tuple(v)  # type: ignore[arg-type]


def _is_pad_values(v: object) -> bool:
    if v is None:
        return True
    return isinstance(v, Mapping) and all(
        isinstance(k, str) and k.isidentifier() and isinstance(x, int | float) and math.isfinite(x)
        for k, x in v.items()
    )

_OPTIONS: tuple[_Option, ...] = (
    _bool("force_eager", False, "apply all passes, never capture: run the optimized graph eagerly"),
    _bool("force_recapture", False, "recapture on every call"),
    _Option(
        "capture_limit", 64, "an int ≥ 1 (below 2**63; not a bool, not a str)",
        lambda v: type(v) is int and 1 <= v <= _MAX_CAPTURE_LIMIT,
        doc="distinct captures per FX graph; beyond it that graph runs eagerly (one warning)",
    ),
    _bool("clone_input", True, "user inputs are copied into capture-owned buffers"),
    _bool("clone_output", False, "return clones of outputs (outputs aliasing inputs excepted)"),
    _Option(
        "use_graph_pool", None,
        "None, a handle from npugraph_ex.graph_pool_handle(), or a device's own (int, int) pool id",
        _is_pool, doc="capture into this pool",
    ),
    _bool("reuse_graph_pool_in_same_fx", True, "the captures of one FX graph share one pool"),
    _bool("frozen_parameter", False, "parameters and static inputs never change address"),
    _bool("remove_noop_ops", True, "built-in pass"),
    _bool("remove_cat_ops", True, "built-in pass"),
    _bool("inplace_pass", True, "built-in pass"),
    _bool("input_inplace_pass", True, "built-in pass"),
    _bool("pattern_fusion_pass", True, "built-in pass"),
    _Option(
        "post_grad_custom_pre_pass", None,
        "None or a callable (gm, example_inputs, config) -> None",
        lambda v: v is None or callable(v), error=PassOptionError,
        doc="user pass before the built-ins",
    ),
    _Option(
        "post_grad_custom_post_pass", None,
        "None or a callable (gm, example_inputs, config) -> None",
        lambda v: v is None or callable(v), error=PassOptionError,
        doc="user pass after the built-ins",
    ),
    _enum("capture_error_mode", "global", CAPTURE_ERROR_MODES,
          "what an unsafe op during capture does"),
    _bool("dump_tensor_data", False, "data dump"),
    _enum("data_dump_stage", "optimized", ("optimized", "original"), "which graph is dumped"),
    _Option(
        "data_dump_dir", "./", "the path (str or os.PathLike) of an existing directory",
        _is_existing_dir, normalise=lambda v: str(os.fspath(v)),  # type: ignore[call-overload]
        doc="dump root",
    ),
    _bool("deadlock_check", False, "analyse multi-stream captures for deadlock risk"),
    _bool("static_kernel_compile", False, "NPU static kernels; elsewhere a no-op with one warning"),
    _bool("disable_static_kernel_compile_cache", False,
          "NPU static kernel cache; elsewhere a no-op with one warning"),
    _Option(
        "capture_sizes", None,
        "None, 'auto', or a non-empty list of ints >= 1 in strictly increasing order "
        "(not bools), e.g. [1, 2, 4, 8, 16]",
        _is_capture_sizes, normalise=_capture_sizes,
        doc="graphs with dynamic shapes: a call is padded up to the next listed size",
    ),
    _Option(
        "pad_values", None,
        "None or a dict {forward argument name (str): finite int, float or bool}, "
        "e.g. {'slots': 63}",
        _is_pad_values, normalise=lambda v: None if v is None else dict(v),  # type: ignore[call-overload]
        doc="the value padded rows of that input take (a scratch KV slot, a pad token)",
    ),
    _enum("mode", "npugraph_ex", ("npugraph_ex",), "the only value"),
)

_BY_NAME: dict[str, _Option] = {o.name: o for o in _OPTIONS}

#: Options that only mean something on an Ascend NPU.
NPU_ONLY_OPTIONS: tuple[str, ...] = ("static_kernel_compile", "disable_static_kernel_compile_cache")


def option_names() -> tuple[str, ...]:
    """Every option name, in the order of the API table."""
    return tuple(_BY_NAME)


def _unknown(name: object) -> OptionError:
    valid = sorted(_BY_NAME)
    close = difflib.get_close_matches(str(name), valid, n=1) if isinstance(name, str) else []
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return OptionError(
        f"unknown option {name!r}.{hint} Valid options: {', '.join(valid)}"
    )


def _pass_identity(fn: Callable[..., Any]) -> str:
    """Qualified name plus the passes' own identity of the pass (its source, or bytecode, and
    what it closes over), so a changed pass changes the config hash."""
    qualname = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    return f"{qualname}:{source_digest(fn)[:16]}"


class CompilerConfig:
    """The options of one compile. Every assignment is validated; unknown names are refused with
    the closest valid name. Build one from an options dict with ``from_options``."""

    __slots__ = tuple(f"_{o.name}" for o in _OPTIONS)

    # Typed attribute declarations (values live in the slots above; see __getattr__).
    force_eager: bool
    force_recapture: bool
    capture_limit: int
    clone_input: bool
    clone_output: bool
    use_graph_pool: object
    reuse_graph_pool_in_same_fx: bool
    frozen_parameter: bool
    remove_noop_ops: bool
    remove_cat_ops: bool
    inplace_pass: bool
    input_inplace_pass: bool
    pattern_fusion_pass: bool
    post_grad_custom_pre_pass: Callable[..., Any] | None
    post_grad_custom_post_pass: Callable[..., Any] | None
    capture_error_mode: str
    dump_tensor_data: bool
    data_dump_stage: str
    data_dump_dir: str
    deadlock_check: bool
    static_kernel_compile: bool
    disable_static_kernel_compile_cache: bool
    capture_sizes: tuple[int, ...] | str | None
    pad_values: dict[str, int | float | bool] | None
    mode: str

    def __init__(self, **options: object) -> None:
        for opt in _OPTIONS:
            if opt.name == "data_dump_dir":
                # The default "./" exists wherever we run; no need to stat it per compile.
                object.__setattr__(self, "_data_dump_dir", opt.default)
            else:
                object.__setattr__(self, f"_{opt.name}", opt.default)
        for name, value in options.items():
            setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not slots: the option names themselves.
        if name in _BY_NAME:
            return object.__getattribute__(self, f"_{name}")
        raise AttributeError(_unknown(name).args[0])

    def __setattr__(self, name: str, value: object) -> None:
        opt = _BY_NAME.get(name)
        if opt is None:
            raise _unknown(name)
        object.__setattr__(self, f"_{name}", opt.validate(value))

    def __delattr__(self, name: str) -> None:
        raise OptionError(f"option {name!r} cannot be deleted; assign its default instead")

    @classmethod
    def from_options(cls, options: Mapping[str, object] | CompilerConfig | None = None) -> CompilerConfig:
        """A fresh config with ``options`` applied; ``None`` gives the defaults."""
        if options is None:
            return cls()
        if isinstance(options, CompilerConfig):
            return options.copy()
        if not isinstance(options, Mapping):
            raise OptionError(
                f"options: value {_describe(options)} is not allowed; allowed: a dict of "
                f"option name to value, a CompilerConfig, or None"
            )
        config = cls()
        for name, value in options.items():
            if not isinstance(name, str) or name not in _BY_NAME:
                raise _unknown(name)
            setattr(config, name, value)
        return config

    def copy(self) -> CompilerConfig:
        new = CompilerConfig.__new__(CompilerConfig)
        for slot in self.__slots__:
            object.__setattr__(new, slot, object.__getattribute__(self, slot))
        return new

    def as_dict(self) -> dict[str, object]:
        """Every option by name (custom passes and the pool as the objects given)."""
        return {name: getattr(self, name) for name in _BY_NAME}

    def non_defaults(self) -> dict[str, object]:
        return {n: v for n, v in self.as_dict().items() if v != _BY_NAME[n].default}

    def canonical(self) -> dict[str, object]:
        """Plain JSON-able options that change the compiled artefact (cache keys hash this):
        passes by identity, a user pool as "user" (its identity is process-local and does not
        change what is compiled), the dump options only when dumping is on, and data_dump_dir as
        given, never made absolute (a relative dir is resolved where the artefact runs), so the
        same model started from another working directory shares its entry."""
        out: dict[str, object] = {}
        for name, value in self.as_dict().items():
            if name in ("post_grad_custom_pre_pass", "post_grad_custom_post_pass"):
                out[name] = None if value is None else _pass_identity(value)  # type: ignore[arg-type]
            elif name == "use_graph_pool":
                out[name] = None if value is None else "user"
            elif name in ("data_dump_dir", "data_dump_stage") and not self.dump_tensor_data:
                out[name] = None
            elif name == "data_dump_dir":
                out[name] = os.fspath(value)  # type: ignore[call-overload]
            else:
                out[name] = value
        return out

    def hash(self) -> str:
        """A stable sha256 of the canonical options, for cache keys."""
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def __iter__(self) -> Iterator[tuple[str, object]]:
        return iter(self.as_dict().items())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CompilerConfig) and self.as_dict() == other.as_dict()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self.non_defaults().items())
        return f"CompilerConfig({body})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (rebuild_config, (self.as_dict(),))


def rebuild_config(options: dict[str, object]) -> CompilerConfig:
    """A config from ``as_dict()`` output (unpickling, cache loads)."""
    config = CompilerConfig()
    for name, value in options.items():
        if name == "data_dump_dir" and not os.path.isdir(str(value)):
            # A config pickled on another machine: keep the value without re-checking it.
            object.__setattr__(config, "_data_dump_dir", value)
        else:
            setattr(config, name, value)
    return config

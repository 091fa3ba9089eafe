"""How each recorded op is re-issued at replay, decided once, at capture time.

For a functional op the candidates are: the public Python binding with ``out=``
(``torch.add(a, b, out=c)``), the ``.out`` overload's operator handle, and computing the result
(with the public binding or the op itself) then ``copy_`` into the recorded output. A candidate
is kept only when, on the capture's own inputs, it gives a bitwise-identical result (NaN-aware;
same dtype, shape and strides) without raising or warning. Among the kept ones the replay uses the
first by a fixed rule (``RULE``), never by timing, so what a replay issues does not depend on the
machine's load at capture:

1. ``copy_into`` (ops whose result is a copy of one input: ``clone``, ``_to_copy``, ``copy``):
   ``out.copy_(input)``, one pass over the data, where ``clone.out`` clones and then copies;
2. ``gather_rows`` (``x[idx]``, aten.index with one 1-D integer index on dim 0):
   ``index_select`` into the recorded output, a copy per row where aten.index copies element
   by element (2-3x faster here), aten.index itself for an index ``index_select`` refuses;
3. the public binding with ``out=`` (one kernel writing the recorded output, no allocation, the
   shortest call path: Python's argument parser, not the schema's stack);
4. the ``.out`` overload's operator handle (the same kernel by a longer call);
5. the public binding computing a fresh result, copied into place (about 1 µs less per call
   than the op's handle);
6. the op itself, copied into place: always available, the reference the others are checked
   against.

In-place ops are re-issued as a bound ``Tensor`` method when calling it dispatches to the same
overload with the same arguments (checked by dispatch, nothing run), else as the op itself.

A decision is the first candidate in rule order that verifies; the later ones are not run.
Decisions are kept per op and argument layout (``_DECIDED``): a later capture of the same
signature verifies, on its own data, the decided candidate (and, should it fail there, the
candidates in rule order until one passes), once: the same signature again in that capture (a
model's next layer) takes what the capture verified.
A ``DecisionJournal`` exports, as plain data, the decisions the captures of one thread used while
it was open (what one cache entry's first call decided); ``seed_kernel_decisions`` imports them,
possibly in another process.

A seeded decision (the candidates that verified where it was made) is used without running its
kernels again only when it is ``trusted``: the
caller vouches that the data is authentic (npugraph_ex's cache passes only entries whose HMAC
verified with this user's key) and the process matches the one that decided: the same torch
build, CPU capability, intra-op threads and numerics flags (``environment()``), and, per op, the
same overload, argument dtypes, shapes, strides, layouts, devices and constants (the key text),
with every candidate it names available here. Those fix which kernel code runs, so the bitwise
check the deciding process made on its capture's data holds here as it would for a recapture
there. Anything else (another build or thread count, a signature not in the seed, a label this
torch lacks, a seed not vouched for) is verified on the capture's data as before.

The candidates themselves and their bitwise check live in cpu_candidates.py."""

from __future__ import annotations

import platform
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import torch

from npugraph_runtime import _compat
from npugraph_runtime.devices.cpu_candidates import (
    Candidate,
    Kind,
    Outs,
    gather_rows,
    gathers_rows,
    out_overload,
    public_binding,
    single_tensor_returns,
    verified,
)
from npugraph_runtime.devices.cpu_scratch import hold_scratch, release_scratch, scratch_held

# re-exported for callers that name an op from here (the schema helpers live in schema.py)
from npugraph_runtime.schema import overload_name as overload_name
from npugraph_runtime.schema import write_positions as write_positions


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.dtype, tuple(value.shape), value.stride(), value.layout, value.device)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _signature(v)) for k, v in value.items()))
    return (type(value), value)


# Ops whose result is a copy of one input, in the result's dtype and layout: that input's position.
_COPY_SOURCE = {"aten::clone": 0, "aten::_to_copy": 0, "aten::lift_fresh_copy": 0, "aten::copy": 1}


@dataclass(frozen=True)
class Decision:
    """What the first capture of one op signature found: its candidates in rule order, the
    first of which verified there. ``trusted``: seeded from an authenticated entry made in this
    environment (see the module docstring); its candidates are not run again."""

    candidates: tuple[Candidate, ...]
    trusted: bool = False


# Decisions by (op, argument layouts and constants, copy_only): a model's repeated layers and
# later captures try the candidates that verified before first. Every capture still verifies,
# on its own data, the candidate it picks.
_DECIDED: dict[Any, Decision] = {}
_DECIDED_MAX = 4096
# Decisions imported with seed_kernel_decisions, by the text of their key, until first used:
# (labels, the intra-op threads a trusted seed holds for, or None).
_SEEDED: dict[str, tuple[tuple[str, ...], int | None]] = {}
# How captures got their decisions in this process: "decided" (candidates verified in rule
# order), "rechecked" (a known decision, verified again on this data), "trusted" (a trusted
# seed, nothing run again), "reused" (verified earlier in the same capture: a model's repeated
# layers, nothing run again).
DECISION_COUNTS: dict[str, int] = {"decided": 0, "rechecked": 0, "trusted": 0, "reused": 0}


class _CaptureChecks(threading.local):
    """What the capture in progress on this thread verified, by key: each signature is checked
    once per capture, on that capture's data (captures are per thread, as dispatch modes are;
    a capture is in progress while it holds the scratch arena)."""

    def __init__(self) -> None:
        self.checked: dict[Any, list[Candidate]] = {}


_CAPTURE = _CaptureChecks()


def capture_checks_begin() -> None:
    """A capture begins on this thread: its kernel checks share one scratch arena, and a
    signature it verified once is not verified again until ``capture_checks_end``."""
    hold_scratch()


def capture_checks_end() -> None:
    release_scratch()
    if not scratch_held():
        _CAPTURE.checked = {}


class _OpenJournals(threading.local):
    journals: tuple[DecisionJournal, ...] = ()


_OPEN = _OpenJournals()


class DecisionJournal:
    """The decisions the captures of one thread use between ``start()`` and ``export()``:
    what one cache entry's first call decided, and nothing else the process decided."""

    def __init__(self) -> None:
        self._used: dict[str, Decision] = {}

    def start(self) -> None:
        """Forget what was noted and note, in this thread, every decision a capture uses."""
        self._used = {}
        if self not in _OPEN.journals:
            _OPEN.journals = (*_OPEN.journals, self)

    def note(self, key: Any, decision: Decision) -> None:
        self._used[_key_text(key)] = decision

    def export(self) -> dict[str, Any]:
        """Stop noting; the decisions noted, with the environment they hold for, as plain data
        (str, int, lists) for ``seed_kernel_decisions``."""
        _OPEN.journals = tuple(j for j in _OPEN.journals if j is not self)
        used, self._used = self._used, {}
        return {"environment": environment(), "decisions": {
            text: _record(d) for text, d in used.items()
        }}


def environment() -> dict[str, Any]:
    """What decides which kernel code an op runs, besides its arguments: a trusted seed must
    have been decided where all of it was the same."""
    return {
        "torch": torch.__version__,
        "git": torch.version.git_version,
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "mkldnn": bool(torch.backends.mkldnn.enabled),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "matmul_precision": _matmul_precision(),
        "flush_denormal": _flush_denormal(),
        "labels": "op binding copy_into gather_rows out_public out_overload",  # this module's candidates
    }


def _matmul_precision() -> list[str]:
    """The float32 matmul precision, legacy and per backend. torch's legacy getter raises once
    only the per-backend setting was used (``torch.backends.mkldnn.matmul.fp32_precision =
    "bf16"``, torch 2.9+), and a bf16 CPU matmul is other kernel code than an fp32 one."""
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:  # "mix of the legacy and new APIs"
        legacy = "per-backend"
    mkldnn = torch.backends.mkldnn
    return [legacy, str(getattr(torch.backends, "fp32_precision", None)),
            *(str(getattr(getattr(mkldnn, part, None), "fp32_precision", None))
              for part in ("matmul", "conv", "rnn"))]


def _flush_denormal() -> bool:
    """Whether denormals flush to zero (torch.set_flush_denormal has no getter)."""
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    return bool((tiny * 1.0).item() == 0.0)


def _possible(func: Any, op: Callable[..., Any], args: Sequence[Any], outs: Outs,
              copy_only: bool) -> list[Candidate]:
    """Every way ``func`` could be re-issued, unverified; the op itself first."""
    possible = [Candidate(Kind.COPY, op, label="op")]
    binding = public_binding(func.namespace, _compat.op_base_name(func))
    if binding is not None:
        possible.append(Candidate(Kind.COPY, binding, label="binding"))
    # out= kernels take one buffer per return: only when every return is a tensor produced here
    # (an undefined optional result, e.g. mkldnn_rnn_layer's workspace, is None)
    if (
        copy_only
        or not single_tensor_returns(func)
        or len(outs) != len(_compat.op_schema(func).returns)
        or not all(t.layout == torch.strided for _, t in outs)
    ):
        return possible
    source = _COPY_SOURCE.get(overload_name(func))
    if source is not None and len(outs) == 1:
        possible.append(Candidate(Kind.COPY_INTO, itemgetter(source), label="copy_into"))
    if len(outs) == 1 and gathers_rows(func, args):
        possible.append(Candidate(Kind.OUT_PUBLIC, gather_rows, label="gather_rows"))
    if binding is not None:
        possible.append(Candidate(Kind.OUT_PUBLIC, binding, label="out_public"))
    overload = out_overload(func)
    if overload is not None:
        possible.append(Candidate(Kind.OUT_OVERLOAD, overload[0], overload[1], label="out_overload"))
    return possible


def _key_text(key: Any) -> str:
    func, args_sig, kwargs_sig, copy_only = key
    return f"{overload_name(func)}|{args_sig!r}|{kwargs_sig!r}|{copy_only}"


def _decide(
    func: Any, op: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], outs: Outs,
    copy_only: bool,
) -> Decision:
    """The first candidate in rule order that verifies on this capture's data: the one the
    replay issues. The later ones are not run: each check runs a kernel on the capture's data,
    and a server's captures (a new size is a new signature) pay for every one."""
    for c in sorted(_possible(func, op, args, outs, copy_only), key=lambda c: c.rank):
        if verified(c, args, kwargs, outs):
            return Decision((c,))
    raise AssertionError("unreachable: the op itself needs no check")


def _recheck(
    decision: Decision, func: Any, op: Callable[..., Any], args: Sequence[Any],
    kwargs: dict[str, Any], outs: Outs, copy_only: bool,
) -> list[Candidate]:
    """The first candidate of a known decision that verifies on this capture's data; where none
    does, the first in rule order that does (``_decide``)."""
    for c in decision.candidates:
        if verified(c, args, kwargs, outs):
            return [c]
    return list(_decide(func, op, args, kwargs, outs, copy_only).candidates)


def out_candidates(
    func: Any, args: Sequence[Any], kwargs: dict[str, Any], outs: Outs, copy_only: bool = False
) -> list[Candidate]:
    """The candidates for a functional op whose fresh results ``outs`` (path into the result,
    tensor) were just computed from ``args`` that verified on them, in rule order: the replay
    issues the first. ``copy_only``: the results alias inputs or each other, so out= kernels do
    not fit."""
    op = _compat.op_entry(func)
    if func.namespace not in ("aten", "prims"):
        # a custom op may have effects its schema does not show: run it once per replay, never
        # again at capture to check another kernel
        return [Candidate(Kind.COPY, op, label="op")]
    key: Any = (func, _signature(args), _signature(kwargs), copy_only)
    try:
        decision = _DECIDED.get(key)
    except TypeError:  # an unhashable constant: decide every time
        DECISION_COUNTS["decided"] += 1
        return list(_decide(func, op, args, kwargs, outs, copy_only).candidates)
    checked = _CAPTURE.checked.get(key) if scratch_held() else None
    if checked is not None and decision is not None:
        DECISION_COUNTS["reused"] += 1
        for journal in _OPEN.journals:
            journal.note(key, decision)
        return list(checked)
    if decision is None and _SEEDED:
        decision = _from_seed(key, func, op, args, outs, copy_only)
    if decision is None:
        how = "decided"
        decision = _decide(func, op, args, kwargs, outs, copy_only)
        if len(_DECIDED) >= _DECIDED_MAX:
            _DECIDED.clear()
        _DECIDED[key] = decision
    else:
        how = "trusted" if decision.trusted else "rechecked"
    DECISION_COUNTS[how] += 1
    for journal in _OPEN.journals:
        journal.note(key, decision)
    picked = (_recheck(decision, func, op, args, kwargs, outs, copy_only) if how == "rechecked"
              else list(decision.candidates))
    if scratch_held():
        _CAPTURE.checked[key] = picked
    return picked


def _record(decision: Decision) -> dict[str, Any]:
    return {"candidates": [c.label for c in decision.candidates]}


def _from_seed(
    key: Any, func: Any, op: Callable[..., Any], args: Sequence[Any], outs: Outs, copy_only: bool
) -> Decision | None:
    seeded = _SEEDED.pop(_key_text(key), None)
    if seeded is None:
        return None
    labels, threads = seeded
    by_label = {c.label: c for c in _possible(func, op, args, outs, copy_only)}
    if any(label not in by_label for label in labels):
        return None  # made by another torch or another version of this module: decide afresh
    candidates = [by_label[label] for label in labels]
    if not candidates:
        return None
    # the thread count may have changed since the seed was taken: checked again here
    trusted = threads is not None and threads == torch.get_num_threads()
    decision = Decision(tuple(sorted(candidates, key=lambda c: c.rank)), trusted)
    _DECIDED[key] = decision
    return decision


def kernel_decisions() -> dict[str, dict[str, list[Any]]]:
    """The decisions made in this process, as plain data (str, lists): key text ->
    {"candidates": [label, ...]} (the candidates that verified, in rule order). A cache entry
    stores what a ``DecisionJournal`` noted instead: only its own captures' decisions."""
    return {_key_text(key): _record(d) for key, d in list(_DECIDED.items())}


def seed_kernel_decisions(decisions: dict[str, Any], trusted: bool = False) -> int:
    """Import decisions exported by a ``DecisionJournal`` (``{"environment": ..., "decisions":
    {...}}``) or by ``kernel_decisions`` (the bare mapping), possibly in another process:
    captures of those signatures verify only the candidates the seed names, on their own data, unless ``trusted`` (the caller vouches the data is authentic) and the
    export's environment is this process's (see the module docstring). Returns how many were
    taken; malformed records raise ValueError naming the record."""
    if not isinstance(decisions, dict):
        raise ValueError(
            f"seed_kernel_decisions: expected a dict of decisions, got {type(decisions).__name__}"
        )
    threads: int | None = None
    if set(decisions) == {"environment", "decisions"}:
        env = decisions["environment"]
        if trusted and env == environment():
            threads = torch.get_num_threads()
        decisions = decisions["decisions"]
        if not isinstance(decisions, dict):
            raise ValueError("seed_kernel_decisions: 'decisions' is not a dict of records")
    taken = 0
    for text, record in decisions.items():
        try:
            # an entry written before the choice followed RULE has [label, cost_ns] pairs
            labels = tuple(str(c[0]) if isinstance(c, list | tuple) else str(c)
                           for c in record["candidates"])
        except (KeyError, TypeError, IndexError) as exc:
            raise ValueError(
                f"seed_kernel_decisions: record {text!r} is not of the form "
                f"{{'candidates': [label, ...]}}: {exc}"
            ) from None
        _SEEDED[str(text)] = (labels, threads)
        taken += 1
    return taken

"""Making one capture: the arguments and buffers it runs on, the warmup, the capture itself.

Everything here runs once per capture, never on a replay; capture_set.py turns what it makes
into the replay closure (bindings.py)."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Sequence
from typing import cast

import torch

from npugraph_runtime import _compat
from npugraph_runtime.core_limit import capture_core_limit
from npugraph_runtime.devices import backend_for
from npugraph_runtime.devices.base import ComputingGraph, DeviceGraph, PoolHandle, computing
from npugraph_runtime.devices.no_launch import Launched, UndoneRun
from npugraph_runtime.errors import CaptureError, PolicyError
from npugraph_runtime.graphs import Graph, graph
from npugraph_runtime.inputs import WriteWatch, mirror, storage_ptr
from npugraph_runtime.keys import Args, Key
from npugraph_runtime.ledger import OutputWatch, is_result, watches_of
from npugraph_runtime.outputs import OutputPlan
from npugraph_runtime.spans import bytes_overlap, non_overlapping
from npugraph_runtime.spec import CapturePolicy, InputSpec, SlotKind

__all__ = ["CAPTURE_RANGE", "Capture", "Slots", "capture_runs_fn", "record", "tensor", "warm_up"]

# Profiler range name (what a trace shows); the backend's compile phases use the same prefix.
CAPTURE_RANGE = "npugraph_ex::capture"

_data_ptr = torch.Tensor.data_ptr


def tensor(args: Args, i: int) -> torch.Tensor:
    """``args[i]``, which the InputSpec makes a tensor (checked before any capture)."""
    return cast(torch.Tensor, args[i])


class Slots:
    """The input indices of each kind, and those whose address the replay path checks."""

    __slots__ = ("constant", "mutated", "static", "user", "watched")

    def __init__(self, spec: InputSpec, policy: CapturePolicy) -> None:
        kinds = spec.kinds
        self.user = [i for i, k in enumerate(kinds) if k is SlotKind.USER]
        self.mutated = [i for i, k in enumerate(kinds) if k is SlotKind.MUTATED]
        self.static = [i for i, k in enumerate(kinds) if k is SlotKind.STATIC]
        self.constant = [i for i, k in enumerate(kinds) if k is SlotKind.CONSTANT]
        # Inputs the graph uses in place whose address the replay path checks. Unchecked
        # (frozen_parameter), the first and the last static input stand for the instance: two,
        # since instances of one class often share the first one (a class-attribute tensor, a
        # shared submodule used first) or the last, and a shared one cannot tell them apart.
        checked_static = (self.static if policy.check_static_addresses
                          else sorted({*self.static[:1], *self.static[-1:]}))
        self.watched = sorted(self.mutated + checked_static)

    def watch_buffers(self, args: Args) -> None:
        """Unchecked static addresses (frozen_parameter) are a promise about parameters, not
        buffers: a forward may re-bind a buffer on every call (``self.steps = self.steps + 1``,
        a running average), and a replay over the old one is wrong from the second call. So
        every static input that is not an ``nn.Parameter`` is checked too (one address each)."""
        extra = [i for i in self.static if i not in self.watched
                 and not isinstance(args[i], torch.nn.Parameter)]
        if extra:
            self.watched = sorted(self.watched + extra)


class Capture:
    """One captured graph and what its replay closure needs kept alive."""

    __slots__ = (
        "__weakref__",
        "addresses",
        "args",
        "buffers",
        "caller_slots",
        "callers",
        "core_limit",
        "graph",
        "key",
        "lent",
        "mirrored",
        "new_tensor",
        "orphans",
        "outputs",
        "own_refs",
        "plan",
        "replay",
        "replayed",
        "watch",
        "watched_ptrs",
    )

    def __init__(
        self, key: Key, graph: DeviceGraph, args: list[object], buffers: list[torch.Tensor],
        mirrored: frozenset[int],
    ) -> None:
        self.key = key
        self.graph = graph
        self.args = args  # what the graph saw: static/mutated inputs in place, user buffers
        self.buffers = buffers
        self.mirrored = mirrored  # user inputs whose buffer mirrors the caller's whole storage
        # input index -> data_ptr at capture, for the inputs the graph uses in place
        self.addresses = {
            i: a.data_ptr() for i, a in enumerate(args) if isinstance(a, torch.Tensor)
        }
        self.watched_ptrs: list[int] = []
        # the caller's mutated tensors, weakly: the capture itself holds aliases of them
        self.callers: list[weakref.ref[torch.Tensor]] = []
        self.caller_slots: list[int] = []  # the input slot of each of ``callers``
        # (static input index, references to the tensor object and uses of its storage that the
        # capture itself holds): see orphaned_captures
        self.own_refs: list[tuple[int, int, int]] = []
        # of those inputs, the ones nothing else referenced when orphaned_captures last looked:
        # another instance's re-bound buffer, not its parameters (copied_inputs)
        self.orphans: list[int] = []
        # the undos of what this capture keeps of other captures' outputs (ledger.owned_by_capture)
        self.lent: list[Callable[[], None]] = []
        # made for a mutated tensor at a new address: whether a later call replays it tells a
        # request's tensor from one that is new on every call (copied_inputs); only such a
        # capture's replay notes it
        self.new_tensor = False
        self.replayed = [False]  # a cell, so the replay closure noting it does not hold self
        self.core_limit = capture_core_limit()
        self.outputs: object = None
        self.watch: OutputWatch | None = None
        self.plan: OutputPlan | None = None
        self.replay: Callable[[Args], object] = _unset

    def keeps(self, lent: list[Callable[[], None]]) -> None:
        """This capture keeps other captures' outputs (``lent``: the undos of ledger.owned_by_capture); they
        are given back when it is released, or when it is collected without a release."""
        self.lent = lent
        if lent:
            weakref.finalize(self, _give_back, lent)

    def release(self) -> None:
        """Let go of the graph, first giving back what it kept of other captures' outputs: a
        ledger's owned count that is briefly above the caller's reads as held, the safe side."""
        _give_back(self.lent)
        self.graph.reset()

    def let_go(self) -> list[int]:
        """The mutated inputs whose tensor the caller let go (a finished request's cache). One
        that is a live capture's static output is not let go even when the caller's tensor
        object is gone (a view it made, ``out.logits[:, -1]``): that capture's replays hand the
        same storage out again, as held logits a sampler scales in place."""
        return [i for i, ref in zip(self.caller_slots, self.callers, strict=True)
                if ref() is None and not watches_of(self.args[i])]  # type: ignore[arg-type]

    def dropped(self) -> bool:
        """Nothing can call this capture with its mutated addresses again (``let_go``), so it is
        the one to replace."""
        return bool(self.let_go())

    def fits(self, args: Args, watched: Sequence[int]) -> bool:
        """The addresses the replay closure checks are the ones this call passes."""
        return [_data_ptr(tensor(args, i)) for i in watched] == self.watched_ptrs


def _give_back(lent: list[Callable[[], None]]) -> None:
    for undo in lent:
        undo()


def storage_uses(t: torch.Tensor) -> int:
    """The C++ uses of ``t``'s storage: one per tensor viewing it (and per Python storage object
    other than the one this call makes to read it)."""
    storage = t.untyped_storage()
    return _storage_uses(storage._cdata) - 1


def orphaned_captures(caps: Sequence[Capture]) -> list[Capture]:
    """The captures of ``caps`` with a static input (a parameter) that nothing but these
    captures references: a model that was dropped. No call can pass that tensor again, so such a
    capture never replays; releasing it frees the weights it holds and its pool, which a server
    swapping models would otherwise accumulate (dynamo's code cache keeps the captures of a
    class's ``forward`` for the process) until capture_limit made every later model run eagerly.
    A reference held elsewhere keeps a capture: to the tensor object (a live module, another
    callable's capture), or to its memory through another tensor (a per-call view of a live
    weight passed as the static input, ``w.t()``: that view object is only ours, its storage is
    not). No local names a static input here: it would be one more reference. Each capture's
    ``orphans`` are set to the inputs that nothing else references."""
    objects: dict[int, int] = {}
    storages: dict[int, int] = {}
    for c in caps:
        for i, n, m in c.own_refs:
            objects[id(c.args[i])] = objects.get(id(c.args[i]), 0) + n
            key = _storage_key(c.args[i])
            storages[key] = storages.get(key, 0) + m
    # beyond those counted: getrefcount's own argument, and the tensor's own use of its storage
    gone = []
    for c in caps:
        c.orphans = [i for i, _, _ in c.own_refs
                     if sys.getrefcount(c.args[i]) - 1 <= objects[id(c.args[i])]
                     and storage_uses(c.args[i]) - 1 <= storages[_storage_key(c.args[i])]]  # type: ignore[arg-type]
        if c.orphans:
            gone.append(c)
    return gone


def _storage_key(t: object) -> int:
    return int(cast(torch.Tensor, t).untyped_storage()._cdata)


_storage_uses = _compat.storage_use_count()


def _unset(args: Args) -> object:
    raise CaptureError("internal: a capture's replay closure was used before it was built")


def warm_up(fn: Callable[..., object], args: Args, slots: Slots, runs: int) -> object:
    """``runs`` eager calls of ``fn``; the last one's result. Every run but the last is undone,
    so side effects land once, as in eager."""
    undone_runs(fn, args, slots, runs - 1)
    return fn(*args)


def undone_runs(fn: Callable[..., object], args: Args, slots: Slots, runs: int) -> None:
    """``runs`` eager calls of ``fn``, each undone (its writes to the mutated inputs and to any
    other tensor), none of them launching a collective: the call's own run does."""
    if runs > 0:
        mutated = [tensor(args, i) for i in slots.mutated]
        snapshot = [t.clone() for t in mutated]
        kept = frozenset(storage_ptr(t) for t in mutated)
        for _ in range(runs):
            with UndoneRun(kept) as run:
                fn(*args)
            run.restore()
            for t, s in zip(mutated, snapshot, strict=True):
                t.copy_(s)


def capture_runs_fn(device: torch.device) -> bool:
    """Whether a capture on ``device`` computes what an eager run does (the device says:
    DeviceBackend.capture_computes), so that its run can be a call's."""
    return bool(backend_for(device).capture_computes)


def record(
    fn: Callable[..., object], name: str, spec: InputSpec, policy: CapturePolicy, slots: Slots,
    key: Key, args: Args, device: torch.device, pool: PoolHandle | None,
    closure: Callable[[Capture], Callable[[Args], object]], as_call: bool = False,
    mirrored: frozenset[int] = frozenset(),
    adoptable: frozenset[int] | None = None,
    new_tensor: bool = False,
) -> Capture:
    """Capture once; again, with mirrored buffers, when the graph turns out to read a user
    input through as_strided (at storage positions a dense buffer does not have). ``closure``
    builds the capture's replay closure.

    ``as_call`` (a graph whose capture computes, see capture_runs_fn): the capture's run is the
    call's, as an eager run would be: the writes of the capture that is kept stay,
    those of a capture made again (mirrored) or refused are undone first. Otherwise the CPU
    capture's writes are undone and its collectives are recorded but not launched.

    ``mirrored``: the inputs an earlier capture of the same fn found read through as_strided,
    mirrored from the start: a capture made again runs fn twice, and a later capture (held
    outputs, a new address) may be made on one rank only. The run to be made again launches
    no collective from its first such read on; those it launched before it are not launched
    again: the new run takes what they left (no_launch.Launched), so a call issues each once.

    ``adoptable`` (clone_input=False): the storages a user tensor may be adopted from as its
    buffer; None: any (see _buffers)."""
    relaunch: list[Launched] = []
    while True:
        g, out, cap_args, buffers, raw_reads = _record_once(
            fn, name, spec, policy, slots, args, mirrored, device, pool, as_call, adoptable,
            relaunch)
        if raw_reads <= mirrored:
            break
        if (c := computing(g)) is not None:
            relaunch = c.launched()
        _undo(g)
        g.reset()
        mirrored |= raw_reads
    cap = Capture(key, g, cap_args, buffers, mirrored)
    cap.callers = [weakref.ref(tensor(args, i)) for i in slots.mutated]
    cap.caller_slots = list(slots.mutated)
    cap.outputs = out
    cap.new_tensor = new_tensor
    try:
        cap.replay = closure(cap)
    except BaseException:
        _undo(g)
        g.reset()
        raise
    if (c := computing(g)) is not None and as_call:
        # every write stays, to the mutated inputs and to any other tensor fn writes (its state):
        # the run was the call's, as an eager run would be (inputs fn may not write were refused)
        c.drop_undo()
    return cap


def _undo(g: DeviceGraph) -> None:
    if (c := computing(g)) is not None:
        c.undo_writes()


def _stop_launching_if_unmirrored(g: ComputingGraph, mirrored: frozenset[int]) -> Callable[[int], None]:
    def seen(slot: int) -> None:
        if slot not in mirrored:
            g.stop_launching()

    return seen


def _record_once(
    fn: Callable[..., object], name: str, spec: InputSpec, policy: CapturePolicy, slots: Slots,
    args: Args, mirrored: frozenset[int], device: torch.device, pool: PoolHandle | None,
    as_call: bool, adoptable: frozenset[int] | None, relaunch: list[Launched],
) -> tuple[DeviceGraph, object, list[object], list[torch.Tensor], frozenset[int]]:
    cap_args, buffers = _buffers(name, policy, slots, args, mirrored, adoptable)
    # statics and user buffers must not be written: replays would not write the caller's
    # tensor (user) or would repeat the write warmups already made (static)
    mutated = {storage_ptr(tensor(args, i)) for i in slots.mutated}
    users = {storage_ptr(b): i for i, b in zip(slots.user, buffers, strict=True)}
    watched = dict(users)
    for i in slots.static:
        watched.setdefault(storage_ptr(tensor(args, i)), i)
    g = Graph(device)
    again = None
    if (c := computing(g)) is not None:
        # a run that is not the call's launches no collective: the call's own run (a warm-up,
        # or the replay after this) issues each one once. Nor does a run from the moment it
        # reads an unmirrored input through as_strided: it is made again, mirrored (record)
        c.keep_writes = c.launch_collectives = as_call
        c.keep_launched = as_call and not set(slots.user) <= mirrored
        c.relaunch = relaunch
        again = _stop_launching_if_unmirrored(c, mirrored)
    watch = WriteWatch({p: i for p, i in watched.items() if p and p not in mutated},
                       {p: i for p, i in users.items() if p}, again)
    with (
        torch.profiler.record_function(CAPTURE_RANGE),
        graph(g, pool=pool, capture_error_mode=policy.capture_error_mode),
        watch,
    ):
        out = fn(*cap_args)
    if watch.written:
        _undo(g)
        g.reset()
        i, op = next(iter(watch.written.items()))
        raise PolicyError(
            f"{name}: fn writes input {i} in place ({op}), but the InputSpec makes it "
            f"{spec.kinds[i].value}: a replay would not write the caller's tensor like "
            "eager does. Declare it mutated (make_graphed_callable(mutated_argnums=...), "
            "SlotKind.MUTATED) or do not write it"
        )
    return g, out, cap_args, buffers, frozenset(watch.raw_reads)


def _buffers(
    name: str, policy: CapturePolicy, slots: Slots, args: Args, mirrored: frozenset[int],
    adoptable: frozenset[int] | None = None,
) -> tuple[list[object], list[torch.Tensor]]:
    """The arguments a capture runs on and its user-input buffers. A buffer is the caller's
    own tensor only under clone_input=False, and only when no other input shares its memory
    and no two of its elements overlap; otherwise it is an owned copy with the caller's
    layout (made dense), so that refilling it never writes memory another input (or another
    element) is read from. A ``mirrored`` input's buffer copies the caller's whole storage
    at the caller's offset and strides (the graph reads it through as_strided). A tensor that
    a capture returned (the previous graph's result across a graph break) is never adopted
    either: a later call's refill would overwrite a result the caller may still hold. Nor is,
    outside ``adoptable`` (when given), a tensor no other capture adopted: a key's later
    captures (another module instance, outputs still held, another thread's call) adopt only
    the tensors its first capture did, which the caller passes again."""
    mutated = {storage_ptr(tensor(args, i)): i for i in slots.mutated}
    for i in slots.user:
        # a user input read through as_strided may reach any byte of its storage; another
        # one only its own bytes, so a disjoint view of a mutated input's storage is fine
        x = tensor(args, i)
        j = next((j for j in slots.mutated if (
            storage_ptr(x) == storage_ptr(tensor(args, j))
            and (i in mirrored or bytes_overlap(x, tensor(args, j))))), None)
        if j is not None and x.numel():
            raise PolicyError(
                f"{name}: user input {i} shares memory with mutated input {j}: a replay "
                f"reads input {i} as copied before fn writes input {j}, eager reads it after. "
                f"Pass input {i} as a separate tensor, or mark it mutated too"
            )
    taken = set(mutated) | {storage_ptr(tensor(args, i)) for i in slots.static}
    cap_args = list(args)
    for i in slots.mutated:
        # an alias (same storage, sizes, strides; not a view, which would keep its base
        # object alive): the capture never keeps the caller's tensor object alive, so a
        # dropped one is seen (see Capture.dropped)
        cap_args[i] = tensor(args, i).detach()
    buffers: list[torch.Tensor] = []
    for i in slots.user:
        x = tensor(args, i)
        ptr = storage_ptr(x)
        if i in mirrored:
            x = mirror(x)
            cap_args[i] = x
        elif (policy.clone_input or (ptr and ptr in taken) or not non_overlapping(x)
              or is_result(x) or (adoptable is not None and ptr not in adoptable)):
            # the graph may depend on the input's layout (a traced view): keep its strides
            # when dense, else dense strides in the same dim order
            x = torch.empty_like(x, memory_format=torch.preserve_format).copy_(x)
            cap_args[i] = x
        taken.add(ptr)
        buffers.append(x)
    return cap_args, buffers

"""The capture manager: GraphedCallable and make_graphed_callable.

A GraphedCallable owns every capture of one callable. The first call for a graph key warms up
and captures; every later call runs one precomputed closure for its key: check the addresses the
capture depends on, copy the user inputs into the capture's buffers, replay, return the outputs.
Everything else is decided at capture time or on a miss: capture_set.py holds the captures (making,
releasing, falling back), misses.py what a call its key's closure cannot serve does (another
capture, copy mode), selection.py which capture a miss makes or replaces, outputs.py what a replay
returns."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from npugraph_runtime.bindings import MISS
from npugraph_runtime.capture_set import BindVariants, ByRun
from npugraph_runtime.counters import CaptureEvent
from npugraph_runtime.devices.base import DeviceGraph
from npugraph_runtime.errors import PolicyError
from npugraph_runtime.keys import Args, Key
from npugraph_runtime.misses import Misses
from npugraph_runtime.spec import CapturePolicy, InputSpec, SlotKind

__all__ = ["CaptureEvent", "GraphedCallable", "make_graphed_callable"]


class GraphedCallable(Misses):
    """Captures ``fn`` into device graphs, one per graph key, and replays them.

    ``fn`` is called positionally with the same arguments as this object. The caller
    guarantees what the spec says: static inputs keep their contents between calls, mutated
    inputs are the only tensors ``fn`` updates in place, every tensor keeps its dtype and device
    (hand-written capture keys them), the dims of a tensor that are not keyed keep their sizes,
    a static or mutated tensor at its captured address keeps its strides (only the address is
    checked), user inputs share no memory with mutated inputs on later calls either (checked at
    capture only), and constant inputs do not change (checked every call).

    The addresses of static inputs select the capture: one FX graph serves every instance of a
    module class, so each distinct set of static addresses gets its own capture of the key,
    kept beside the others (up to ``capture_limit``). With ``check_static_addresses=False`` only
    the first and the last static input's addresses are checked (the representatives of an
    instance), with every static input that is not an ``nn.Parameter`` (a buffer a forward may
    re-bind): a re-bound parameter between them goes unnoticed, and so do instances that
    share both (a class-attribute tensor used first and a shared submodule used last). Mutated inputs' addresses select the
    capture too while the caller keeps the earlier tensors (requests with their own KV caches);
    a capture whose mutated tensors the caller dropped is the one replaced.

    With ``clone_output=False`` the returned tensors are the graph's static outputs, and a replay
    never changes a value the caller still holds: when a capture's outputs (or views of them)
    are still referenced at its next replay, another capture of the key with its own output
    memory replays instead (made once, reason ``held_outputs``; a decode loop alternates between
    two). At ``capture_limit`` such a call runs eagerly instead (counted, one warning).
    With ``clone_input=False`` the first call's user tensors become the capture's buffers and a
    later call at another address overwrites them (a call whose inputs overlap them raises
    PolicyError instead); a user tensor that shares memory with another input, or overlaps
    itself, gets an owned buffer, and so does one the graph reads through as_strided (its buffer
    mirrors the caller's whole storage, copied every call). Outputs that view a user input are
    views of the caller's tensor, as in eager.

    Threads: one call at a time per GraphedCallable (a lock around each call); a call's results
    stay intact while another thread's calls run, by the rule above.
    Refused at capture (PolicyError): fn writing a user or static input in place (declare it
    mutated), and a user input sharing bytes with a mutated input (a disjoint view of the same
    storage is fine, unless the graph reads it through as_strided).

    ``functional=True`` says ``fn`` is a traced graph (the backend's): it runs the same ops on
    every call and writes nothing but its mutated inputs. On a device whose capture computes (the
    CPU) the last warmup run of a new key is then the capture itself: its writes to the mutated
    inputs stay and the call returns clones of its outputs, so the graph runs once, not twice.
    There, any later capture of a key but a forced one (of any fn) is the call's run in the same
    way, so that fn's collectives run once a call, as on an accelerator."""

    # ---- the hot path -------------------------------------------------------------------
    def __call__(self, *args: object) -> object:
        if len(args) != self._n:
            raise PolicyError(
                f"{self.name} was called with {len(args)} arguments; its InputSpec has {self._n}"
            )
        try:
            key = () if self._key is None else self._key(args)
        except (AttributeError, IndexError, TypeError):
            self._check_kinds(args)  # names the input of the wrong type
            raise
        with self._lock:
            run = self._runs.get(key)
            if run is None:
                return self._miss(key, args)
            out = run(args)
            if out is MISS:
                return self._reselect(key, args, run)
            return out

    def bind(self, held: Sequence[object]) -> Callable[[Args], object] | None:
        """This callable with its last ``len(held)`` inputs always ``held`` (a model's parameters,
        as the cache's serving plan holds them): the bound call takes the leading inputs only, so
        no call builds or re-picks the whole argument tuple, and the held inputs' addresses are
        checked over the held objects themselves (a ``.data`` swap is still seen). None unless
        every held input is static. A call its key's current capture cannot serve (new key,
        other addresses, held outputs, a fallback) takes the general path,
        ``self(*call, *held)``."""
        held = tuple(held)
        n0 = self._n - len(held)
        if not held or n0 < 0 or any(k is not SlotKind.STATIC for k in self._spec.kinds[n0:]):
            return None
        variants = BindVariants()
        self._bound.add(variants)  # _release empties it with the captures
        key_of, runs, lock, by_run = self._key, self._runs, self._lock, variants.by_run

        def bound(call: Args) -> object:
            if len(call) == n0:
                with lock:
                    try:
                        key = () if key_of is None else key_of(call)
                    except (AttributeError, IndexError, TypeError):
                        return self(*call, *held)  # names the input of the wrong type
                    run = by_run.get(runs.get(key))
                    if run is not None:
                        out = run(call)
                        if out is not MISS:
                            return out
                    out = self(*call, *held)
                    self._follow(variants.by_run, key, held)  # keeps variants alive
                    return out
            return self(*call, *held)  # raises, naming the count

        return bound

    def _follow(self, variants: ByRun, key: Key, held: tuple[object, ...]) -> None:
        """After a general call: ``variants`` has a bound closure for the key's current capture,
        and none for a capture that is gone."""
        live = {c.replay: c for c in self._captures.get(key, [])}
        for run in [r for r in variants if r not in live]:
            del variants[run]
        current = self._runs.get(key)
        if current in live and current not in variants and not self._copies(live[current]):
            variants[current] = self._replay_closure(live[current], held)

    def reset(self) -> None:
        """Release every graph; the next call of each key captures again."""
        with self._lock:
            self._release()
            self._released = 0
            self._pool = None
            self.fell_back = False
            self.fallback_reason = None
            self._counters.count_reset()
    @property
    def num_captures(self) -> int:
        """Captures held now, every capture of every key counted."""
        return self._total

    @property
    def graphs(self) -> dict[Key, DeviceGraph]:
        """The first capture of each key (see ``captures`` for all of them)."""
        return {k: caps[0].graph for k, caps in self._captures.items()}

    @property
    def captures(self) -> dict[Key, list[DeviceGraph]]:
        """Every capture of each key: one per distinct set of static addresses, and more where
        the caller held outputs."""
        return {k: [c.graph for c in caps] for k, caps in self._captures.items()}

    @property
    def policy(self) -> CapturePolicy:
        return self._policy

    @property
    def spec(self) -> InputSpec:
        return self._spec

    def __repr__(self) -> str:
        return (
            f"GraphedCallable({self.name!r}, captures={self._total}, "
            f"fell_back={self.fell_back})"
        )


_POLICY_NAMES = tuple(f.name for f in dataclasses.fields(CapturePolicy))


def make_graphed_callable(
    fn: Callable[..., object],
    example_inputs: Sequence[object],
    static_argnums: Sequence[int] = (),
    mutated_argnums: Sequence[int] = (),
    *,
    device: torch.device | str | None = None,
    **policies: Any,
) -> GraphedCallable:
    """A GraphedCallable for hand-written capture. Tensors are user inputs unless listed in
    ``static_argnums`` (never copied: the caller keeps them at one address, e.g. parameters) or
    ``mutated_argnums`` (updated in place by ``fn``, e.g. a KV cache); ints, floats and bools
    key the graph (one capture per value); other non-tensors must not change between calls; every
    dim of a user or mutated tensor keys the graph. ``policies`` are CapturePolicy fields.
    Nothing is captured until the first call."""
    unknown = sorted(set(policies) - set(_POLICY_NAMES))
    if unknown:
        raise PolicyError(
            f"unknown capture policy {', '.join(unknown)}; allowed: {', '.join(_POLICY_NAMES)}"
        )
    spec = InputSpec.infer(example_inputs, static_argnums, mutated_argnums)
    policy = CapturePolicy(**policies)
    if device is None:
        first = next((x for x in example_inputs if isinstance(x, torch.Tensor)), None)
        device = first.device if first is not None else None
    return GraphedCallable(fn, spec, policy, device=device)

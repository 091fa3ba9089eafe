"""A call its key's replay closure cannot serve (other addresses, another core limit, held
outputs, a new key): another capture of the key that can replay it, copy mode (a slot whose tensor
is new on every call becomes COPY_IN_OUT: copied into a buffer of the key's own, its history
moving it back to PINNED when the caller keeps the tensors), or a new capture. Entering or
leaving copy mode changes bindings, so the key's replay closures are generated again
(capture_set._rebind); while the key copies, a call no closure serves is served over its
buffers (_copying_call)."""

from __future__ import annotations

from collections.abc import Callable

from npugraph_runtime.bindings import MISS
from npugraph_runtime.capture import (
    Capture,
    tensor,
)
from npugraph_runtime.capture_set import CaptureSet, renewed_statics
from npugraph_runtime.copied_inputs import CopiedInputs
from npugraph_runtime.core_limit import capture_core_limit
from npugraph_runtime.counters import (
    CAPTURE_LIMIT,
    FORCE_EAGER,
    MUTATED_INPUT_CHANGE,
    NEW_KEY,
    STATIC_INPUT_CHANGE,
    logger,
)
from npugraph_runtime.keys import NEEDS_GRAD, Args, Key
from npugraph_runtime.selection import choose

__all__ = ["Misses"]




class Misses(CaptureSet):
    """What GraphedCallable does on a miss of its hot path."""

    # ---- capture ------------------------------------------------------------------------
    def _miss(self, key: Key, args: Args) -> object:
        if self.fell_back:
            return self._fn(*args)
        if key and key[-1] is NEEDS_GRAD:
            # this key's calls need autograd: they run eagerly from now on, never captured
            def eager(a: Args) -> object:
                self._counters.count_grad_eager()
                return self._fn(*a)

            self._runs[key] = eager
            self._warn_grad(args)
            return eager(args)
        if self._policy.force_eager:
            self._fall_back(FORCE_EAGER)
            return self._fn(*args)
        self._release_orphans()
        if self._total >= self._policy.capture_limit:
            self._fall_back(CAPTURE_LIMIT)
            return self._fn(*args)
        self._slots.watch_buffers(args)  # before any replay closure reads the watched inputs
        renewed = self._orphaned.pop(key, None)
        if renewed is not None and not self._policy.force_recapture:
            # every capture of this key was released, its static inputs dropped (another key's
            # call found them so: dynamic shapes, a buffer re-bound on every call)
            out = self._copy_statics(key, args, renewed)
            if out is not MISS:
                return out
            # as new (a swapped model's key warms up again), noting whether a call replays it
            return self._capture(key, args, NEW_KEY, new_tensor=True)
        return self._capture(key, args, NEW_KEY)

    def _reselect(self, key: Key, args: Args, tried: Callable[[Args], object]) -> object:
        """The key's last capture (``tried``) cannot replay this call (other addresses, another
        core limit, or its outputs are still held): replay another capture of the key that can,
        or make one (over the key's buffers while it copies)."""
        copied = self._copied.get(key)
        if copied is not None and copied.leaving:  # the call told this key to leave copying
            self._stop_copying(key, copied)
            copied = None
        for c in self._captures[key]:
            if c.replay is not tried:
                out = c.replay(args)
                if out is not MISS:
                    self._runs[key] = c.replay
                    return out
                if copied is not None and copied.leaving:
                    return self._reselect(key, args, c.replay)
        if copied is None:
            return self._choose(key, args)
        return self._copying_call(key, args, copied)

    def _copying_call(self, key: Key, args: Args, copied: CopiedInputs) -> object:
        """A call of a key that copies, which none of its captures replays: served over the
        buffers (a capture made over them, or another copied input), then copied back."""
        sub = copied.enter(args)
        if sub is None:
            self._stop_copying(key, copied)
            return self._choose(key, args)
        if self._captures.get(key):
            out = self._choose(key, sub)
        else:  # every capture of the key was released (its static inputs dropped)
            out = self._another(key, sub, STATIC_INPUT_CHANGE)
        return copied.leave(out, args)

    def _choose(self, key: Key, args: Args) -> object:
        """No capture of the key replays this call: which one it makes, and what it replaces."""
        caps = self._captures[key]
        choice = choose(self.name, self._slots, caps, args, capture_core_limit(),
                        self._total < self._policy.capture_limit)
        gone = choice.replacing
        # (while the key copies some inputs, others may be new on every call too: _copy_more)
        new_tensor = (choice.reason in (MUTATED_INPUT_CHANGE, STATIC_INPUT_CHANGE)
                      and not self._policy.force_recapture)
        if gone is None:
            if choice.reason == STATIC_INPUT_CHANGE:  # another model: is an earlier one gone?
                released = self._release_orphans()
                renewed = next((r for c in released if c.key == key
                                and (r := renewed_statics(c, self._slots.static))), None)
                if renewed and new_tensor:
                    # a static input (a buffer the forward re-binds, ``self.steps =
                    # self.steps + 1``) that is new on every call: read from a buffer of the
                    # key's own, refilled before each replay
                    out = self._copy_statics(key, args, renewed)
                    if out is not MISS:
                        return out
            return self._another(key, args, choice.reason, new_tensor)
        if new_tensor and gone.new_tensor and not gone.replayed[0] and gone.dropped():
            # a capture made for a new tensor, dropped before any later call replayed it: this
            # input is new on every call, and each call would capture
            churned = gone.let_go()
            copied = self._copied.get(key)
            if copied is not None:
                out = self._copy_more(key, args, copied, churned, written=True, replacing=gone)
                if out is not MISS:
                    return out
            elif CopiedInputs.eligible(churned, args):
                return self._start_copying(key, args, CopiedInputs(churned, args, churned))
        return self._capture(key, args, choice.reason, replacing=gone, new_tensor=new_tensor)

    def _copy_statics(self, key: Key, args: Args, renewed: dict[int, int]) -> object:
        """Copy the static inputs of ``renewed`` (see renewed_statics) that this call passes anew, if
        they can be (beside those the key copies already); else MISS."""
        churned = [i for i, ptr in renewed.items() if tensor(args, i).data_ptr() != ptr]
        copied = self._copied.get(key)
        if copied is not None:
            return self._copy_more(key, args, copied, churned)
        if not CopiedInputs.eligible(churned, args):
            return MISS
        return self._start_copying(key, args, CopiedInputs(churned, args))

    def _copy_more(self, key: Key, args: Args, copied: CopiedInputs, churned: list[int],
                   written: bool = False, replacing: Capture | None = None) -> object:
        """The key copies some inputs already (``args`` hold its buffers): copy ``churned`` too
        (``written``: mutated ones, copied back), and capture over them; MISS where they cannot
        be. A layer's re-bound buffer beside the other graph's result it updates in place."""
        churned = [i for i in churned if i not in copied.slots]
        if not CopiedInputs.eligible(churned, args):
            return MISS
        copied.add(churned, args, written)
        self._rebind(key)  # its captures over fewer buffers pin them now
        sub = copied.substitute(args)
        self._copy([tensor(sub, i) for i in churned], [tensor(args, i) for i in churned])
        self._counters.count_copied(len(churned))
        if replacing is not None:
            return self._capture(key, sub, MUTATED_INPUT_CHANGE, replacing=replacing)
        return self._another(key, sub, STATIC_INPUT_CHANGE)

    def _start_copying(self, key: Key, args: Args, copied: CopiedInputs) -> object:
        """From now on ``key``'s slots ``copied`` are COPY_IN_OUT: its calls copy those inputs
        into buffers of the key's own (and the mutated ones back: copied_inputs), so that its
        capture over the buffers replays."""
        self._copied[key] = copied
        limit = self._policy.capture_limit
        copied.copy = self._copy
        copied.room = lambda live: self._total + live < limit
        self._counters.count_copied(len(copied.slots))
        logger.info("%s: key %s copies input(s) %s on every call (a new tensor on every call)",
                    self.name, key, copied.slots)
        return self._copying_call(key, args, copied)

    def _stop_copying(self, key: Key, copied: CopiedInputs) -> None:
        """The key's slots are PINNED again (its captures over the buffers miss on the caller's
        tensors)."""
        if self._copied.get(key) is not copied:
            return
        del self._copied[key]
        self._rebind(key)

"""Replay kernels of the CPU graph: ops whose result is a copy of an input replay as one
``out.copy_(src)``, bitwise equal to eager; the kernel a replay issues is the first verified one
by a fixed rule, never by timing, so the same capture replays the same kernels; capture
decisions are kept per op signature, and a re-capture still verifies, on its own data, the
kernel it will use."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import replace

import npugraph_runtime as ngr
import pytest
import torch
import torch.nn.functional as F
from npugraph_runtime._compat import npugraph_ex_counters, op_entry
from npugraph_runtime.devices import cpu_kernels
from npugraph_runtime.devices.cpu_audit import audit_kernels
from npugraph_runtime.devices.cpu_kernels import Kind

# replay kernels chosen by a bitwise check against eager: nox -s ci reruns them
# under a second kernel variant
pytestmark = pytest.mark.numerics


def _capture(fn: Callable[..., object], *inputs: torch.Tensor) -> tuple[object, object]:
    g = ngr.Graph("cpu")
    with torch.no_grad(), ngr.graph(g):
        out = fn(*inputs)
    return g, out


def _kernels(g: object) -> dict[str, str]:
    return {row.op: row.kernel for row in audit_kernels(g, rounds=1, min_sample_s=0)}  # type: ignore[arg-type]


def _repeat_kv(kv: torch.Tensor) -> torch.Tensor:
    b, h, s, d = kv.shape  # transformers' repeat_kv: expand, then reshape copies
    return kv[:, :, None].expand(b, h, 3, s, d).reshape(b, h * 3, s, d) * 1.0


COPY_CASES: dict[str, tuple[Callable[[torch.Tensor], object], str]] = {
    "repeat_kv clone of an expanded tensor": (_repeat_kv, "aten::clone"),
    "clone of a transpose": (lambda x: torch.clone(x.transpose(1, 2)), "aten::clone"),
    "clone to channels_last": (lambda x: x.clone(memory_format=torch.channels_last), "aten::clone"),
    "contiguous of a transpose": (lambda x: x.transpose(0, 3).contiguous(), "aten::clone"),
    "float to half": (lambda x: x.to(torch.float16), "aten::_to_copy"),
    "float to int (rounding)": (lambda x: (x * 100).to(torch.int32), "aten::_to_copy"),
    "functional copy with broadcast": (
        lambda x: torch.ops.aten.copy.default(torch.empty(2, 3, 5, 7), x[:1]), "aten::copy"),
}


@pytest.mark.parametrize("case", list(COPY_CASES))
def test_copy_ops_replay_as_one_copy_bitwise_equal_to_eager(case: str) -> None:
    fn, op = COPY_CASES[case]
    x = torch.randn(2, 3, 5, 7)
    g, out = _capture(fn, x)
    assert _kernels(g)[op] == "copy_into"
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        g.replay()  # type: ignore[attr-defined]
        expected = fn(x)
        assert isinstance(out, torch.Tensor) and isinstance(expected, torch.Tensor)
        assert out.stride() == expected.stride() and out.dtype == expected.dtype
        assert torch.equal(out, expected)


def test_nan_and_negative_zero_survive_the_copy_kernel() -> None:
    x = torch.tensor([[float("nan"), -0.0, float("inf"), 1.5]]).expand(3, 4)
    g, out = _capture(lambda t: t.clone(), x)
    assert _kernels(g)["aten::clone"] == "copy_into"
    g.replay()  # type: ignore[attr-defined]
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out.view(torch.int32), x.contiguous().view(torch.int32))


GATHERS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "rows of a KV buffer": lambda kv, idx: kv[idx] * 1.0,
    "rows of a per-layer view": lambda kv, idx: kv[1:][idx] + 0.0,
    "rows of a transpose": lambda kv, idx: kv.transpose(1, 2)[idx] * 1.0,
}


@pytest.mark.parametrize("case", list(GATHERS))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_row_gathers_replay_as_index_select_bitwise_equal_to_eager(
        case: str, dtype: torch.dtype) -> None:
    """``kv[idx]`` (a decode step's read of its requests' KV slots) replays as index_select,
    a copy per row; on every index eager accepts, a negative one included, bitwise eager."""
    fn = GATHERS[case]
    kv = torch.randn(9, 6, 5)
    idx = torch.tensor([3, 0, 7, 3], dtype=dtype)
    g, out = _capture(fn, kv, idx)
    assert _kernels(g)["aten::index.Tensor"] == "gather_rows"
    for fresh in ([7, 1, 1, 2], [-1, 0, -8, 5], [0, 0, 0, 0]):
        idx.copy_(torch.tensor(fresh, dtype=dtype))
        kv.copy_(torch.randn_like(kv))
        g.replay()  # type: ignore[attr-defined]
        assert torch.equal(out, fn(kv, idx))  # type: ignore[arg-type]
    idx.copy_(torch.tensor([0, 9, 0, 0], dtype=dtype))
    with pytest.raises(IndexError):  # refused as eager refuses it
        g.replay()  # type: ignore[attr-defined]


def test_other_index_reads_keep_their_own_kernel() -> None:
    """A 2-D index, two indices: not a row gather."""
    kv = torch.randn(9, 6, 5)
    idx = torch.tensor([[3, 0], [4, 3]])
    for fn in (lambda kv: kv[idx] * 1.0,
               lambda kv: kv[idx[0], idx[1]] * 1.0):
        g, _ = _capture(fn, kv)
        assert _kernels(g)["aten::index.Tensor"] != "gather_rows"


def test_a_recapture_of_the_same_signature_reuses_the_decision() -> None:
    x = torch.randn(4, 8)
    fn = lambda t: torch.sin(t) + 1  # noqa: E731
    _capture(fn, x)
    decided = cpu_kernels.kernel_decisions()
    assert any(k.startswith("aten::sin|") for k in decided)
    g, out = _capture(fn, x)
    assert cpu_kernels.kernel_decisions() == decided  # nothing re-timed
    x.copy_(torch.randn_like(x))
    g.replay()  # type: ignore[attr-defined]
    assert torch.equal(out, fn(x))  # type: ignore[arg-type]


def test_a_wrong_kernel_in_the_decisions_is_caught_by_the_recapture() -> None:
    """A decision whose cheapest kernel gives another result (here a fake that writes zeros,
    standing for a kernel that is wrong on this capture's data) is re-verified and not used."""
    x = torch.randn(4, 8)
    fn = lambda t: torch.cos(t * 3.0)  # noqa: E731
    _capture(fn, x)
    key = next(k for k in cpu_kernels._DECIDED if cpu_kernels.overload_name(k[0]) == "aten::cos")
    decision = cpu_kernels._DECIDED[key]

    def zeros(*args: object, out: torch.Tensor) -> torch.Tensor:
        return out.zero_()

    wrong = cpu_kernels.Candidate(Kind.OUT_PUBLIC, zeros, label="out_public")
    cpu_kernels._DECIDED[key] = replace(decision, candidates=(wrong, *decision.candidates))
    try:
        g, out = _capture(fn, x)
        for _ in range(5):
            x.copy_(torch.randn_like(x))
            g.replay()  # type: ignore[attr-defined]
            assert torch.equal(out, fn(x))  # type: ignore[arg-type]
    finally:
        cpu_kernels._DECIDED[key] = decision


def test_exported_decisions_seed_another_process() -> None:
    x = torch.randn(3, 5)
    fn = lambda t: torch.tanh(t) * 2.0  # noqa: E731
    _capture(fn, x)
    exported = {k: v for k, v in cpu_kernels.kernel_decisions().items()
                if k.startswith("aten::tanh|") and "(3, 5)" in k}
    assert exported
    with _fresh_decisions():  # as in a fresh process
        assert cpu_kernels.seed_kernel_decisions(exported) == len(exported)
        before = dict(cpu_kernels.DECISION_COUNTS)
        g, out = _capture(fn, x)
        assert cpu_kernels.DECISION_COUNTS["rechecked"] > before["rechecked"]  # the seed's
        after = cpu_kernels.kernel_decisions()
        assert all(after[k] == v for k, v in exported.items())
        x.copy_(torch.randn_like(x))
        g.replay()  # type: ignore[attr-defined]
        assert torch.equal(out, fn(x))  # type: ignore[arg-type]


@contextlib.contextmanager
def _fresh_decisions() -> Iterator[None]:
    saved = dict(cpu_kernels._DECIDED)
    cpu_kernels._DECIDED.clear()
    try:
        yield
    finally:
        cpu_kernels._DECIDED.clear()
        cpu_kernels._DECIDED.update(saved)


# Seeds written when the choice was timed carry [label, cost_ns] pairs: whatever the costs say
# (here the .out handle, or the op's own handle, timed cheapest), the rule picks the out= binding
LEGACY_COSTS = {
    "out= handle timed cheaper": {"op": 9000, "binding": 9000, "out_public": 900, "out_overload": 500},
    "op timed cheaper": {"op": 500, "binding": 9000, "out_public": 90000, "out_overload": 90000},
}


@pytest.mark.parametrize("case", list(LEGACY_COSTS))
def test_the_rule_picks_the_out_binding_whatever_a_seed_timed(case: str) -> None:
    costs = LEGACY_COSTS[case]
    x = torch.randn(7, 3)
    fn = lambda t: torch.mul(t, t) + 1.0  # noqa: E731
    _capture(fn, x)
    exported = {k: v for k, v in cpu_kernels.kernel_decisions().items()
                if k.startswith("aten::mul.Tensor|") and "(7, 3)" in k}
    labels = {lab for v in exported.values() for lab in v["candidates"]}
    assert labels == {"out_public"}  # the first by the rule: the later ones are not run
    with _fresh_decisions():
        cpu_kernels.seed_kernel_decisions({
            k: {"candidates": [[lab, cost] for lab, cost in costs.items()],
                "copy_costs": [0]} for k in exported})
        g, out = _capture(fn, x)
        assert _kernels(g)["aten::mul.Tensor"] == "out_public"
        assert torch._C._VariableFunctions.mul in _callees(g, "aten.mul.Tensor")
        for _ in range(5):
            x.copy_(torch.randn_like(x))
            g.replay()  # type: ignore[attr-defined]
            assert torch.equal(out, fn(x))  # type: ignore[arg-type]


def _callees(g: object, op: str) -> list[object]:
    """What the first replay line of ``op`` calls (a copy and the op, for compute-and-copy)."""
    per_op, lines, namespace = g._replay.__ops__  # type: ignore[attr-defined]
    first = next(f for step, _kind, f in per_op if str(step.func) == op)
    return [namespace[name] for name in re.findall(r"(v\d+)\(", lines[first])]


def test_an_inplace_unary_op_without_a_tensor_method_replays_through_its_binding() -> None:
    def fn(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(t * 2.0, inplace=True) * t

    x = torch.randn(5, 9)
    g, out = _capture(fn, x)
    assert _callees(g, "aten.silu_.default") == [torch._C._nn.silu_]
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        g.replay()  # type: ignore[attr-defined]
        assert torch.equal(out, fn(x))  # type: ignore[arg-type]


def _inplace_writes(kv: torch.Tensor, x: torch.Tensor, slots: torch.Tensor,
                    pos: torch.Tensor) -> torch.Tensor:
    kv.index_put_((slots, pos), x)
    y = x * 3.0
    y.add_(x, alpha=2.0)
    torch.ops.aten.add_.Scalar(y, 2)  # its method, y.add_(2), reaches add_.Tensor instead
    return y


def test_inplace_ops_replay_as_their_methods_where_the_method_is_the_op() -> None:
    """An in-place op is re-issued as its Tensor method when calling the method dispatches to
    this very overload with these arguments, found by dispatch (nothing runs, nothing of the
    written tensor is copied); else as the op itself."""
    kv, x = torch.zeros(6, 5, 4), torch.randn(3, 4)
    slots, pos = torch.tensor([4, 1, 4]), torch.tensor([0, 2, 3])
    g, out = _capture(_inplace_writes, kv, x, slots, pos)
    (put,) = _callees(g, "aten.index_put_.default")
    assert getattr(put, "__name__", None) == "index_put_" and getattr(put, "__self__", None) is kv
    (add,) = _callees(g, "aten.add_.Tensor")
    assert getattr(add, "__name__", None) == "add_"
    assert _callees(g, "aten.add_.Scalar") == [op_entry(torch.ops.aten.add_.Scalar)]
    expected_kv = kv.clone()
    for _ in range(4):
        x.copy_(torch.randn_like(x))
        expected = _inplace_writes(expected_kv, x, slots, pos)
        g.replay()  # type: ignore[attr-defined]
        assert torch.equal(out, expected)  # type: ignore[arg-type]
        assert torch.equal(kv, expected_kv)


def test_the_kernel_checks_of_a_capture_share_scratch_memory_freed_at_its_end() -> None:
    """Each check of a candidate writes scratch outputs: while a capture holds the arena they
    are views of one block that grows to the largest check (no fresh pages per check),
    disjoint within a check; the capture's end frees it."""
    from npugraph_runtime.devices.cpu_scratch import (
        arena_nbytes,
        hold_scratch,
        release_scratch,
        scratch_for,
    )

    a, b = torch.randn(64, 33), torch.randn(7, 5).t()
    hold_scratch()
    try:
        first = scratch_for([a, b])
        again = scratch_for([b])
        assert arena_nbytes() >= a.nbytes + b.nbytes
    finally:
        release_scratch()
    assert first[0].untyped_storage().data_ptr() == again[0].untyped_storage().data_ptr()
    assert first[1].data_ptr() >= first[0].data_ptr() + a.nbytes
    assert first[1].stride() == b.stride() and torch.equal(first[1], -b)
    assert arena_nbytes() == 0
    outside = scratch_for([a])[0]
    assert outside.untyped_storage().data_ptr() != first[0].untyped_storage().data_ptr()
    g, y = _capture(lambda t: torch.mm(t, t.t()) * 2.0, a)  # checks out= kernels
    assert arena_nbytes() == 0
    g.replay()  # type: ignore[attr-defined]
    assert torch.equal(y, torch.mm(a, a.t()) * 2.0)  # type: ignore[arg-type]


def _namespace_and_name(op: str) -> tuple[str, str]:
    namespace, name = op.split("::")
    return namespace, name.split(".")[0]


def test_a_llama_replays_out_kernels_through_their_public_bindings() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )).eval()
    ids = torch.randint(0, 96, (2, 5))
    g, out = _capture(lambda t: model(input_ids=t).logits, ids)
    kernels = _kernels(g)
    assert "out_public" in kernels.values(), kernels
    # the rule, not the machine's load, picks: a capture of the same model from scratch
    # replays the same kernels
    with _fresh_decisions():
        again, _ = _capture(lambda t: model(input_ids=t).logits, ids)
        assert _kernels(again) == kernels
    for _ in range(5):
        ids.copy_(torch.randint(0, 96, (2, 5)))
        g.replay()  # type: ignore[attr-defined]
        with torch.no_grad():
            expected = model(input_ids=ids).logits
        assert torch.equal(out, expected)  # type: ignore[arg-type]


@pytest.fixture
def fresh_decisions() -> object:
    """As in a fresh process: no decision made, none seeded; the suite's are put back."""
    saved, seeded = dict(cpu_kernels._DECIDED), dict(cpu_kernels._SEEDED)
    cpu_kernels._DECIDED.clear()
    cpu_kernels._SEEDED.clear()
    yield
    cpu_kernels._DECIDED.clear()
    cpu_kernels._DECIDED.update(saved)
    cpu_kernels._SEEDED.clear()
    cpu_kernels._SEEDED.update(seeded)


def _journaled(fn: Callable[..., object], *inputs: torch.Tensor) -> dict[str, object]:
    journal = cpu_kernels.DecisionJournal()
    journal.start()
    _capture(fn, *inputs)
    return journal.export()


def _counts_of(fn: Callable[..., object], x: torch.Tensor) -> dict[str, int]:
    """How a capture of ``fn`` got its decisions; its replays equal eager on fresh data."""
    before = dict(cpu_kernels.DECISION_COUNTS)
    g, out = _capture(fn, x)
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        g.replay()  # type: ignore[attr-defined]
        assert torch.equal(out, fn(x))  # type: ignore[arg-type]
    return {k: cpu_kernels.DECISION_COUNTS[k] - before[k] for k in before}


def _mm_tanh(t: torch.Tensor) -> torch.Tensor:
    return torch.tanh(t @ t.T) * 2.0


def test_a_journal_exports_only_the_decisions_its_captures_used(fresh_decisions: object) -> None:
    _capture(torch.sinh, torch.randn(3, 7))
    exported = _journaled(_mm_tanh, torch.randn(4, 6))
    decisions = exported["decisions"]
    assert isinstance(decisions, dict)
    assert {k.split("|")[0] for k in decisions} >= {"aten::mm", "aten::tanh", "aten::mul.Tensor"}
    assert not any(k.startswith("aten::sinh|") for k in decisions)
    assert exported["environment"] == cpu_kernels.environment()
    # a decision made before the journal started and used while it is open is the entry's too
    again = _journaled(_mm_tanh, torch.randn(4, 6))
    assert again["decisions"] == decisions


def test_a_trusted_seed_of_this_environment_runs_no_candidate_again(fresh_decisions: object) -> None:
    exported = _journaled(_mm_tanh, torch.randn(4, 6))
    cpu_kernels._DECIDED.clear()
    assert cpu_kernels.seed_kernel_decisions(exported, trusted=True) == 3
    counts = _counts_of(_mm_tanh, torch.randn(4, 6))
    assert counts == {"decided": 0, "rechecked": 0, "trusted": 3, "reused": 0}


@pytest.mark.parametrize("why", ["not vouched for", "other threads", "other torch build",
                                 "threads changed after seeding", "bare mapping"])
def test_a_seed_not_trusted_here_is_verified_on_the_capture_data(
    fresh_decisions: object, why: str
) -> None:
    exported = _journaled(_mm_tanh, torch.randn(4, 6))
    env = dict(exported["environment"])  # type: ignore[call-overload]
    if why == "other threads":
        env["threads"] = env["threads"] + 1
    if why == "other torch build":
        env["git"] = "0" * 40
    data: dict[str, object] = {**exported, "environment": env}
    if why == "bare mapping":
        data = exported["decisions"]  # type: ignore[assignment]
    cpu_kernels._DECIDED.clear()
    cpu_kernels.seed_kernel_decisions(data, trusted=why != "not vouched for")
    threads = torch.get_num_threads()
    if why == "threads changed after seeding":
        torch.set_num_threads(threads + 1)
    try:
        counts = _counts_of(_mm_tanh, torch.randn(4, 6))
    finally:
        torch.set_num_threads(threads)
    assert counts == {"decided": 0, "rechecked": 3, "trusted": 0, "reused": 0}


def test_a_trusted_seed_for_another_signature_or_kernel_is_decided_afresh(
    fresh_decisions: object,
) -> None:
    """A seed is looked up by the op's full signature and names candidates by label: a
    decision for other strides, or one naming a kernel this op lacks (copy_into for tanh), is
    never applied to this op; it is decided here, every candidate verified."""
    exported = _journaled(_mm_tanh, torch.randn(4, 6))
    decisions = dict(exported["decisions"])  # type: ignore[call-overload]
    [tanh] = [k for k in decisions if k.startswith("aten::tanh|")]
    [mm] = [k for k in decisions if k.startswith("aten::mm|")]
    # the mm decision moved to another stride signature; tanh claims a kernel it does not have
    decisions[mm.replace("(6, 1)", "(1, 4)")] = decisions.pop(mm)
    decisions[tanh] = {"candidates": [["copy_into", 0]], "copy_costs": [0]}
    cpu_kernels._DECIDED.clear()
    cpu_kernels.seed_kernel_decisions({**exported, "decisions": decisions}, trusted=True)
    counts = _counts_of(_mm_tanh, torch.randn(4, 6))
    assert counts == {"decided": 2, "rechecked": 0, "trusted": 1, "reused": 0}


def _two_layers(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for _ in range(2):
        x = torch.tanh(x @ w) * 2.0
    return x


def test_a_signature_is_verified_once_per_capture(fresh_decisions: object) -> None:
    """A model's next layer (the same op signatures) takes what its capture verified for the
    layer before; the next capture verifies them again, on its own data."""
    x, w = torch.randn(4, 6), torch.randn(6, 6)
    before = dict(cpu_kernels.DECISION_COUNTS)
    g, out = _capture(_two_layers, x, w)
    first = {k: cpu_kernels.DECISION_COUNTS[k] - before[k] for k in before}
    assert first == {"decided": 3, "rechecked": 0, "trusted": 0, "reused": 3}
    before = dict(cpu_kernels.DECISION_COUNTS)
    _capture(_two_layers, torch.randn(4, 6), torch.randn(6, 6))
    second = {k: cpu_kernels.DECISION_COUNTS[k] - before[k] for k in before}
    assert second == {"decided": 0, "rechecked": 3, "trusted": 0, "reused": 3}
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()  # type: ignore[attr-defined]
        assert torch.equal(out, _two_layers(x, w))  # type: ignore[arg-type]


def test_a_malformed_seed_names_the_record() -> None:
    with pytest.raises(ValueError, match="record 'aten::x'"):
        cpu_kernels.seed_kernel_decisions({"aten::x": {"candidates": 5}})  # type: ignore[dict-item]


def test_the_audit_times_replay_and_eager_for_each_rewritten_op() -> None:
    x = torch.randn(8, 16)
    g, _ = _capture(lambda t: (t @ t.T).relu().clone(), x)
    rows = audit_kernels(g, rounds=3)  # type: ignore[arg-type]
    assert {r.op for r in rows} >= {"aten::mm", "aten::relu", "aten::clone"}
    assert all(r.replay_s > 0 and r.eager_s > 0 for r in rows)


def _gqa_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   pos: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                   write_between: bool = False) -> torch.Tensor:
    """A decode step as transformers writes it: update the static cache, repeat_kv, attend."""
    k_cache.index_copy_(2, pos, k_new)
    v_cache.index_copy_(2, pos, v_new)
    b, h, s, d = k_cache.shape
    k = k_cache[:, :, None].expand(b, h, 3, s, d).reshape(b, h * 3, s, d)
    v = v_cache[:, :, None].expand(b, h, 3, s, d).reshape(b, h * 3, s, d)
    if write_between:  # the cache changes after the copies: the copies must stay
        k_cache.mul_(0.5)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("write_between", [False, True])
def test_grouped_kv_attention_replays_equal_to_eager(write_between: bool) -> None:
    def inputs() -> list[torch.Tensor]:
        return [torch.randn(2, 6, 1, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8),
                torch.tensor([3]), torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)]

    static = inputs()
    fn = lambda *a: _gqa_attention(*a, write_between=write_between)  # noqa: E731
    g, out = _capture(fn, *static)
    kernels = [row.op for row in audit_kernels(g, rounds=1, min_sample_s=0)]  # type: ignore[arg-type]
    # without a write in between, the attention reads the cache itself: no repeat_kv copies
    assert ("aten::clone" in kernels) == write_between
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in kernels
    for step in range(5):
        fresh = inputs()
        fresh[3] = torch.tensor([step])
        for s, f in zip(static, fresh, strict=True):
            s.copy_(f)
        eager_state = [t.clone() for t in fresh]
        g.replay()  # type: ignore[attr-defined]
        with torch.no_grad():
            expected = fn(*eager_state)
        assert torch.equal(out, expected)  # type: ignore[arg-type]
        assert torch.equal(static[1], eager_state[1]) and torch.equal(static[2], eager_state[2])


B, KV_HEADS, REP, SEQ, DIM = 1, 2, 2, 8, 16


def repeat_kv(x: torch.Tensor) -> torch.Tensor:
    return x[:, :, None].expand(B, KV_HEADS, REP, SEQ, DIM).reshape(B, KV_HEADS * REP, SEQ, DIM)


def scaled_keys_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    keys = repeat_kv(k)
    keys.mul_(2.0)  # the repeated copy is written after repeat_kv: attention must read it
    return F.scaled_dot_product_attention(q, keys, repeat_kv(v))


@torch.no_grad()
def test_grouped_kv_shortcut_refused_when_the_repeated_copy_is_written_after_the_clone() -> None:
    # Captured on a zero KV cache (a fresh StaticCache, static buffers made with torch.zeros):
    # there the scaled copy equals the cache bitwise, so only the recording can tell them apart.
    fn = ngr.make_graphed_callable(
        scaled_keys_attention,
        (torch.randn(B, KV_HEADS * REP, 1, DIM), torch.randn(B, KV_HEADS, SEQ, DIM),
         torch.randn(B, KV_HEADS, SEQ, DIM)),
        name="gqa_scaled")
    fn(torch.zeros(B, KV_HEADS * REP, 1, DIM), torch.zeros(B, KV_HEADS, SEQ, DIM),
       torch.randn(B, KV_HEADS, SEQ, DIM))
    assert npugraph_ex_counters()["captured_gqa_scaled"] == 1
    for _ in range(5):
        q = torch.randn(B, KV_HEADS * REP, 1, DIM)
        k, v = torch.randn(B, KV_HEADS, SEQ, DIM), torch.randn(B, KV_HEADS, SEQ, DIM)
        torch.testing.assert_close(fn(q, k, v), scaled_keys_attention(q, k, v))
    assert fn.num_captures == 1

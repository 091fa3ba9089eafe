"""The serving path (npugraph_ex.inference.cache_compile) on the methods users write: keyword-only
defaults, methods that update the Python state they read, a static cache initialised by the first
call, train/eval modes set after the first call. Every call's output (and the state afterwards)
equals eager's, cold and warm, and a capture is counted."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from npugraph_cache.secret import KEY_ENV
from torch._dynamo.utils import counters

from npugraph_ex.inference import cache_compile

CALLS = 6
STEP = 0  # a module global a served method increments


@pytest.fixture(autouse=True)
def own_cache_key(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, str(tmp_path_factory.mktemp("key") / "cache.key"))
        yield


class KeywordOnly(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def step(self, x: torch.Tensor, *, gain: float = 2.0) -> torch.Tensor:
        return torch.relu(self.proj(x)) * gain


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_method_with_a_keyword_only_default(tmp_path: Path, start: str) -> None:
    """A method with a keyword-only default is served over several calls, equal to eager (the
    since removed direct plan's probe once re-made dynamo's function without its keyword-only
    defaults: the entry's second call raised "missing 1 required keyword-only argument")."""
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    model = KeywordOnly().eval()
    if start == "warm":
        cache_compile(model.step, dynamic=False, cache_dir=tmp_path)(torch.randn(4, 16))
    fn = cache_compile(model.step, dynamic=False, cache_dir=tmp_path)
    for _ in range(6):
        x = torch.randn(4, 16)
        with torch.no_grad():
            want = model.step(x)
        torch.testing.assert_close(fn(x), want)
    assert sum(v for k, v in counters["npugraph_ex"].items() if k.startswith("captured_")) >= 1


class Stateful(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.calls = 0
        self.scale = 1.0
        self.hist: list[torch.Tensor] = []

    def count(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.proj(x) * self.calls

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        self.scale = self.scale * 0.5
        return self.proj(x) * self.scale

    def remember(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        self.hist.append(y)
        return y * len(self.hist)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        global STEP
        STEP += 1
        return self.proj(x) * STEP


def _state(model: Stateful) -> tuple[int, float, int, list[torch.Tensor]]:
    return model.calls, model.scale, STEP, [h.clone() for h in model.hist]


@pytest.mark.parametrize("start", ["cold", "warm"])
@pytest.mark.parametrize("method", ["count", "decay", "remember", "step"])
def test_a_method_updating_state_it_reads(tmp_path: Path, method: str, start: str) -> None:
    """An entry replays the values its trace read: the attribute guards are not re-checked on a
    call, and the loaded function's globals are a copy. ``self.calls += 1`` returned the first
    call's result on every call and left calls at 1; ``self.hist.append(y)`` left one item in
    the list (the entry replays the traced list); ``global STEP; STEP += 1`` never changed the
    user's STEP."""
    global STEP
    counters.clear()
    torch._dynamo.reset()  # the methods' code objects are shared by the cases
    torch.manual_seed(0)
    STEP = 0
    if start == "warm":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.no_grad():
                cache_compile(getattr(Stateful(), method), dynamic=False, cache_dir=tmp_path)(
                    torch.randn(2, 8))
    STEP = 0
    model = Stateful().eval()
    eager = copy.deepcopy(model)
    fn = cache_compile(getattr(model, method), dynamic=False, cache_dir=tmp_path)
    with pytest.warns(UserWarning, match="would repeat the value it was traced with"):
        for _ in range(CALLS):
            x = torch.randn(2, 8)
            before = STEP
            with torch.no_grad():
                got = fn(x)
            ours = _state(model)
            STEP = before  # eager's turn from the same global
            with torch.no_grad():
                want = getattr(eager, method)(x)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(ours, _state(eager))
    assert sum(v for k, v in counters["npugraph_ex"].items() if k.startswith("captured_")) >= 1


class LazyCacheDecoder(torch.nn.Module):
    """A transformers Llama whose StaticCache allocates on its first update (transformers 4.56+),
    served by its decode step alone: that first served call initialises the cache."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        from npugraph_ex.models import static_cache

        config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2)
        self.lm = transformers.LlamaForCausalLM(config).eval()
        self.cache = static_cache(config, 1, 16, torch.device("cpu"), torch.float32)

    def decode(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        out = self.lm(token, past_key_values=self.cache, use_cache=True, cache_position=position)
        return out.logits


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_a_decode_step_whose_first_call_initialises_the_static_cache(
        tmp_path: Path, start: str) -> None:
    """The entry was traced with ``is_initialized`` False, so every call replayed the cache's
    lazy initialisation: the cache was zeroed at each step and the logits went wrong from the
    second step on."""
    counters.clear()
    torch._dynamo.reset()
    if start == "warm":
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.no_grad():
                cache_compile(LazyCacheDecoder().decode, dynamic=False, cache_dir=tmp_path)(
                    torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]))
    torch.manual_seed(0)
    model = LazyCacheDecoder()
    eager = copy.deepcopy(model)
    fn = cache_compile(model.decode, dynamic=False, cache_dir=tmp_path)
    token = torch.randint(0, 128, (1, 1))
    with pytest.warns(UserWarning, match="is_initialized"), torch.no_grad():
        for step in range(CALLS):
            position = torch.tensor([step])
            got, want = fn(token, position), eager.decode(token, position)
            torch.testing.assert_close(got, want)
            token = want[:, -1].argmax(-1, keepdim=True)
    assert sum(v for k, v in counters["npugraph_ex"].items() if k.startswith("captured_")) >= 1


class Normed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_train_and_eval_after_the_first_call(tmp_path: Path, start: str) -> None:
    """``model.train()`` after the first served call: the eval entry kept replaying, so BatchNorm
    used its running statistics instead of the batch's and never updated them (wrong outputs in
    train mode, and wrong running statistics after ``eval()`` again). The mode is checked on
    every call; train mode gets an entry of its own."""
    counters.clear()
    torch._dynamo.reset()
    if start == "warm":
        warm = Normed().eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.no_grad():
                fn = cache_compile(warm.forward, dynamic=False, cache_dir=tmp_path)
                fn(torch.randn(6, 8))
                warm.train()
                fn(torch.randn(6, 8))
    torch.manual_seed(0)
    model = Normed().eval()
    eager = copy.deepcopy(model)
    fn = cache_compile(model.forward, dynamic=False, cache_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(12):
            if step in (4, 8):
                for m in (model, eager):
                    m.train(step == 4)
            x = torch.randn(6, 8)
            with torch.no_grad():
                got, want = fn(x), eager(x)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(model.norm.running_mean, eager.norm.running_mean)
            torch.testing.assert_close(model.norm.running_var, eager.norm.running_var)
    assert len(fn._entries) == 2  # one per mode
    assert sum(v for k, v in counters["npugraph_ex"].items() if k.startswith("captured_")) >= 2
    if start == "warm":
        assert counters["npugraph_ex_cache"]["loaded"] == 2


class Block(Normed):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y * 2 if self.training else y  # a branch on the submodule's own mode


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Block()
        self.b = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _set_modes(model: Stack, step: int) -> None:
    if step == 3:
        model.a.train()  # a submodule alone
    elif step == 5:
        model.a.norm.eval()  # a module inside it
    elif step == 7:
        model.b.training = True  # the flag set directly
    elif step == 9:
        model.eval()  # back to the first entry's modes
    elif step == 11:
        fresh = Block().train()  # a submodule replaced by one in another mode
        fresh.load_state_dict(model.a.state_dict())
        model.a = fresh


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_a_submodules_mode_set_alone_after_the_first_call(tmp_path: Path, start: str) -> None:
    """``model.a.train()``, ``model.a.norm.eval()`` or ``model.b.training = True`` after the
    first served call: the entry made in eval mode kept replaying (only the top module's flag was
    read), so BatchNorm and the mode branch gave eval results in train mode. Each ``training``
    flag the code read is checked on every call; each set of modes gets an entry."""
    if start == "warm":
        warm = Stack().eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn = cache_compile(warm.forward, dynamic=False, cache_dir=tmp_path)
            for step in range(13):
                _set_modes(warm, step)
                fn(torch.randn(6, 8))
    counters.clear()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Stack().eval()
    eager = copy.deepcopy(model)
    fn = cache_compile(model.forward, dynamic=False, cache_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(14):
            for m in (model, eager):
                torch.manual_seed(step)
                _set_modes(m, step)
            x = torch.randn(6, 8)
            with torch.no_grad():
                got, want = fn(x), eager(x)
            torch.testing.assert_close(got, want)
            for block in ("a", "b"):
                torch.testing.assert_close(model.get_submodule(block).norm.running_mean,
                                           eager.get_submodule(block).norm.running_mean)
    # eval; a train; a.norm eval; b train too. All eval again is the first entry's modes, and
    # the replaced a in train mode the second's (looked up again after the assignment)
    assert len(fn._entries) == 4
    assert sum(v for k, v in counters["npugraph_ex"].items() if k.startswith("captured_")) >= 4
    if start == "warm":
        assert counters["npugraph_ex_cache"]["loaded"] == 4
        assert counters["npugraph_ex_cache"]["compiled"] == 0

"""What every benchmark receives: the device, how hard to try, and a progress bar factory."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")


@dataclass
class BenchContext:
    device: torch.device
    out: Path
    quick: bool = False
    runs: int = 30
    inductor_budget_s: float = 300.0
    progress: bool = True
    log: list[str] = field(default_factory=list)
    deadline: float | None = None  # time.monotonic() after which long work is skipped
    decode_cases: tuple[str, ...] = ()  # (c): labels of the cases to run; empty: all
    # writes bench.json with a section still running (its figures so far), for a run that is
    # killed before the section ends (gpu_check's time limits)
    save_partial: Callable[[Any], None] | None = None

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def seconds_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def partial(self, section: Any) -> None:
        if self.save_partial is not None:
            self.save_partial(section)

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    def steps(self, items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
        """`items` with a tqdm progress bar (plain iteration when tqdm is missing or disabled)."""
        if self.progress:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                yield from tqdm(items, desc=desc, total=total, leave=False, dynamic_ncols=True)
                return
        yield from items

    def say(self, text: str) -> None:
        self.log.append(text)
        if self.progress:
            try:
                from tqdm import tqdm

                tqdm.write(text)
                return
            except ImportError:
                pass
        print(text, flush=True)


def fmt_exc(exc: BaseException) -> str:
    """One line: the exception type and its message's meaningful lines, at most 400 characters."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("Set TORCH", "You can suppress",
                                                      "import torch._dynamo", "torch._dynamo.config"))]
    text = f"{type(exc).__name__}: {' '.join(lines)}" if lines else type(exc).__name__
    return text[:400]

"""When the prefetch thread issues the next batch: the ``prefetch_delay`` of a pipeline.

Why: most of issuing a batch (its upload, the gather launches, the slot views) is Python
that holds the GIL. Issued as soon as a staging slot frees, it runs while the training
thread enters the next step and runs its forward pass, which also need the GIL; issued a
little later it can fall into the step's ``loss.backward()``, where the training thread
waits without the GIL while PyTorch's autograd thread works. On the H200 host, in one
process with interleaved rounds (10M-row skip-gram, benchmarks/RESULTS.md, 2026-12-04),
waiting 0.4-0.7 ms after the slot freed made depth 1 8-13% faster on two machines and
up to 8% slower on a third, whose Python ran about 1.6x slower. The best wait depends on
the machine and on the user's step, so by default (``"auto"``, CUDA only) each run
measures a few candidates and keeps the fastest (:class:`_DelayTuner`).

Only the time at which copies are issued changes: ordering (events, the issue lock) and
therefore every result are the same for any delay.

Threads: :meth:`_DelayTuner.delay` is called by the prefetch thread, :meth:`_DelayTuner.
step_done` by the training thread. Both only read and write plain attributes (the GIL
makes each of those atomic); a race can at worst count one step under a neighbouring
candidate.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Optional, Sequence, Union

from ._errors import StpipeTypeError, StpipeValueError

__all__: List[str] = []

#: fractions of the warm-up step time tried by the tuner (0: issue as soon as a slot frees)
FRACTIONS = (0.0, 0.15, 0.3)
#: steps run with no delay before the trials; the step time is the median of the later half
WARMUP = 10
#: steps per trial block (the first of each block is not counted: the previous
#: candidate's batch may still be arriving)
BLOCK = 4
#: times each candidate gets a block (the order alternates forward and backward)
CYCLES = 6
#: a delay is kept only if its median step is this much shorter than no delay's
MARGIN = 0.02


def check_delay(value: Any) -> Union[str, float]:
    """Validate ``Pipeline(prefetch_delay=...)``: ``"auto"`` or seconds >= 0.

    Raises:
        StpipeTypeError: not a string or a real number (``bool`` included).
        StpipeValueError: a string other than ``"auto"``, a negative or non-finite number.
    """
    if isinstance(value, str):
        if value != "auto":
            raise StpipeValueError(f"prefetch_delay must be 'auto' or seconds >= 0, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise StpipeTypeError(
            f"prefetch_delay must be 'auto' or a number of seconds, got {type(value).__name__}"
        )
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise StpipeValueError(f"prefetch_delay must be 'auto' or seconds >= 0, got {value!r}")
    return v


class _DelayTuner:
    """Chooses a run's prefetch delay by timing its steps (one tuner per run).

    Steps ``0 .. warmup-1`` run with no delay; their later half gives the step time ``T``.
    Then each candidate ``f * T`` (``f`` in ``fractions``) is applied for ``block`` steps
    at a time, ``cycles`` times, interleaved so a drift of the machine's speed spreads
    over all of them. The candidate with the shortest median step wins, unless it beats no
    delay by less than ``margin``; that delay then stays for the rest of the run.

    A step's time is the time between the ends of two consecutive successful steps: the
    step during which a batch was issued is the one its delay can slow or speed up.
    """

    def __init__(self, fractions: Sequence[float] = FRACTIONS, warmup: int = WARMUP,
                 block: int = BLOCK, cycles: int = CYCLES, margin: float = MARGIN) -> None:
        if not fractions or fractions[0] != 0.0:
            raise StpipeValueError(f"fractions must start with 0.0, got {tuple(fractions)}")
        if warmup < 2 or block < 2 or cycles < 1:
            raise StpipeValueError(
                f"expected warmup >= 2, block >= 2, cycles >= 1, got {warmup}, {block}, {cycles}"
            )
        self.fractions = tuple(float(f) for f in fractions)
        self.warmup, self.block, self.cycles, self.margin = warmup, block, cycles, margin
        n = len(self.fractions)
        order: List[int] = []
        for c in range(cycles):
            order += list(range(n)) if c % 2 == 0 else list(range(n - 1, -1, -1))
        self._order = order
        self._trial_end = warmup + block * len(order)
        self._done = 0  # successful steps so far
        self._last_end: Optional[float] = None
        self._warm: List[float] = []
        self._samples: List[List[float]] = [[] for _ in self.fractions]
        #: step time ``T`` (seconds) measured in the warm-up
        self.step_s: Optional[float] = None
        #: the delay kept after the trials (seconds), ``None`` while tuning
        self.chosen_s: Optional[float] = None

    def _candidate(self, step: int) -> Optional[int]:
        """Index of the candidate in force while step ``step`` runs (None: not a trial)."""
        if self.step_s is None or step < self.warmup or step >= self._trial_end:
            return None
        return self._order[(step - self.warmup) // self.block]

    def delay(self) -> float:
        """Seconds to wait, after the slot frees, before issuing the batch that the next
        step to run will overlap with (prefetch thread)."""
        if self.chosen_s is not None:
            return self.chosen_s
        c = self._candidate(self._done)
        return 0.0 if c is None else self.fractions[c] * self.step_s

    def step_done(self, t: float) -> None:
        """A step ended successfully at time ``t`` (``time.perf_counter()``, training thread)."""
        step = self._done  # the step that just ended
        last, self._last_end = self._last_end, t
        self._done = step + 1
        if last is None or self.chosen_s is not None:
            return
        dt = t - last
        if step < self.warmup:
            if step >= self.warmup // 2:
                self._warm.append(dt)
            if step == self.warmup - 1:
                self.step_s = statistics.median(self._warm)
            return
        c = self._candidate(step)
        if c is not None and (step - self.warmup) % self.block != 0:
            self._samples[c].append(dt)
        if self._done >= self._trial_end:
            self._choose()

    def _choose(self) -> None:
        meds = [statistics.median(s) if s else math.inf for s in self._samples]
        best = min(range(len(meds)), key=meds.__getitem__)
        if best != 0 and not meds[best] < (1.0 - self.margin) * meds[0]:
            best = 0
        self.chosen_s = self.fractions[best] * (self.step_s or 0.0)
        self._medians = meds

    def report(self) -> Optional[Dict[str, Any]]:
        """What the tuning found (for benchmarks and logs), or ``None`` before it ends."""
        if self.chosen_s is None:
            return None
        return {
            "step_ms": round(1e3 * (self.step_s or 0.0), 4),
            "candidates_ms": [round(1e3 * f * (self.step_s or 0.0), 4) for f in self.fractions],
            "median_step_ms": [round(1e3 * m, 4) if math.isfinite(m) else None for m in self._medians],
            "chosen_ms": round(1e3 * self.chosen_s, 4),
        }

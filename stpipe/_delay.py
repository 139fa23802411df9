"""``Pipeline(prefetch_delay="auto")``: choosing the prefetch delay by the GPU's own clock.

Why a delay at all (``stpipe/pipeline.py``, ``prefetch_delay``): most of issuing a batch is
Python that holds the GIL. Issued as soon as a staging slot frees, it competes with the
training thread's step entry and forward pass; issued a little later, it can fall into
the step's ``loss.backward()``, where the training thread waits without the GIL. On the
H200 host (benchmarks/RESULTS.md, 2026-12-04) a hand-set 0.4-0.7 ms made the 10M-row
skip-gram 8-13% faster on three machines of four and 2-10% slower on the fourth.

How :class:`_DelayTuner` chooses. A first tuner (commit 845f2c2, removed in ce2f267)
timed steps on the training thread's clock and chose delays that made the run 10-16%
slower. A CPU-side step time can mislead: the training thread may run ahead of the GPU
for a few steps, and the delay's cost then shows up later, on the GPU. This tuner times
steps where they end: a CUDA event is recorded on the compute stream at the exit of each
successful step, and a block's time is the GPU time between the event before it and its
last one. Work the GPU has queued is counted where it runs, so a backlog built in one
block cannot make it look fast at the next block's expense.

The candidates are fractions of the GPU's step time measured in a warm-up with no delay.
Candidates apply to *batches* (the prefetch thread asks :meth:`_DelayTuner.delay_for`
the delay of the batch it is about to issue), in blocks of consecutive batches, the
candidates interleaved round by round. A block of ``timed + depth`` batches times its
``timed`` steps whose own batch and the batch issued during them were both issued with
the block's delay. The shortest median wins, unless it beats no delay by less than
``margin``; the choice then holds for the rest of the run and for later runs of the same
pipeline.

Only the time at which copies are issued changes: every ordering (events, the issue
lock) and therefore every result is the same for any delay.

Threads: :meth:`_DelayTuner.delay_for` runs on the prefetch thread and only reads
attributes that :meth:`_DelayTuner.step_done` (training thread) sets, each in one
assignment; ``start`` is published last, so a reader that sees it sees the candidates.
Streams: :meth:`_DelayTuner.step_done` records its event on the stream it is given (the
step's compute stream) and never waits for it; it reads events only once ``query()``
says they have completed.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Dict, List, Optional, Sequence

from ._errors import StpipeValueError

__all__: List[str] = []

#: fractions of the warm-up's GPU step time tried (0: issue as soon as a slot frees)
FRACTIONS = (0.0, 0.1, 0.2, 0.3)
#: successful steps run with no delay before the trials; the later half gives the step time
WARMUP = 10
#: steps timed per block
TIMED = 4
#: blocks per candidate (each round runs every candidate once, the order rotating)
ROUNDS = 6
#: a delay is kept only if its median step is this much shorter than no delay's
MARGIN = 0.02


class _DelayTuner:
    """Chooses a pipeline's prefetch delay from GPU-side step times.

    Args:
        depth: the pipeline's prefetch depth (>= 1).
        record: called at each timed step's exit with the compute stream; returns an
            event-like object with ``query() -> bool`` and ``elapsed_time(end) -> ms``
            (``torch.cuda.Event(enable_timing=True)`` recorded on that stream).
        fractions, warmup, timed, rounds, margin: see the module constants.
    """

    def __init__(self, depth: int, record: Callable[[Any], Any], *,
                 fractions: Sequence[float] = FRACTIONS, warmup: int = WARMUP,
                 timed: int = TIMED, rounds: int = ROUNDS, margin: float = MARGIN) -> None:
        fr = tuple(float(f) for f in fractions)
        if not fr or fr[0] != 0.0 or any(not (math.isfinite(f) and f >= 0) for f in fr):
            raise StpipeValueError(f"fractions must start with 0.0 and be >= 0, got {tuple(fractions)}")
        if depth < 1 or warmup < 3 or timed < 1 or rounds < 1:
            raise StpipeValueError(
                f"expected depth >= 1, warmup >= 3, timed >= 1, rounds >= 1, "
                f"got {depth}, {warmup}, {timed}, {rounds}"
            )
        self.depth, self.fractions = int(depth), fr
        self.warmup, self.timed, self.rounds, self.margin = int(warmup), int(timed), int(rounds), float(margin)
        self.block = self.timed + self.depth
        n = len(fr)
        #: candidate of each block: round r runs the candidates rotated by r
        self.order = [(r + i) % n for r in range(self.rounds) for i in range(n)]
        self._record = record
        self._events: Dict[int, Any] = {}  # step index -> its exit event
        self._samples: List[List[float]] = [[] for _ in fr]
        self._cpu: Dict[int, float] = {}  # step index -> perf_counter at exit (diagnostic)
        self._cpu_samples: List[List[float]] = [[] for _ in fr]
        self._warm_steps: List[int] = []
        #: the GPU's step time in the warm-up (seconds), once measured
        self.step_s: Optional[float] = None
        #: candidate delays in seconds (``fractions`` x ``step_s``)
        self.delays: Optional[List[float]] = None
        #: the first batch of the trials (set with the delays; ``None`` before)
        self.start: Optional[int] = None
        #: the delay kept (seconds); ``None`` while tuning
        self.chosen_s: Optional[float] = None
        self._read: set = set()  # blocks timed (or dropped for a failed step)
        self._medians: List[Optional[float]] = []
        self._cpu_medians: List[Optional[float]] = []

    # ------------------------------------------------------------ prefetch thread
    def delay_for(self, idx: int) -> float:
        """Seconds to wait, after its slot frees, before issuing batch ``idx``."""
        chosen = self.chosen_s
        if chosen is not None:
            return chosen
        start = self.start  # published after the delays
        if start is None or idx < start:
            return 0.0
        b = (idx - start) // self.block
        if b >= len(self.order):
            return 0.0
        return self.delays[self.order[b]]  # type: ignore[index]

    # ------------------------------------------------------------ training thread
    @property
    def done(self) -> bool:
        """Whether the delay has been chosen."""
        return self.chosen_s is not None

    def step_done(self, idx: int, stream: Any, t: float) -> None:
        """Step ``idx`` ended successfully at ``t`` (``time.perf_counter()``): record its
        event on ``stream`` (while its block may be timed) and read the events that have
        completed. Call before the step's staging slot is freed; no-op once chosen."""
        if self.chosen_s is not None:
            return
        start = self.start
        if start is None or idx < start + self.block * len(self.order):
            self._events[idx] = self._record(stream)
            self._cpu[idx] = t
        if start is None:
            self._warm_steps.append(idx)
            if len(self._warm_steps) >= self.warmup:
                self._try_step_time(idx)
        else:
            self._read_blocks(idx)

    def _ms(self, first: int, last: int) -> Optional[float]:
        """GPU ms from the exit of step ``first`` to that of ``last``, or ``None`` while
        either event has not completed. Both steps must have been recorded."""
        a, b = self._events[first], self._events[last]
        if not (a.query() and b.query()):
            return None
        return float(a.elapsed_time(b))

    def _try_step_time(self, idx: int) -> None:
        """The warm-up's step time (the median GPU time between consecutive successful
        steps of its later half), once their events have completed; then publish the
        candidates, starting at a batch not yet issued."""
        warm = self._warm_steps
        # the first consecutive pairs after the warm-up's first half (fixed once found:
        # the latest steps may not complete for a while)
        want = max(1, self.warmup - self.warmup // 2 - 1)
        later = warm[self.warmup // 2:]
        pairs = [(a, b) for a, b in zip(later, later[1:]) if b == a + 1][:want]
        if len(pairs) < want:
            if len(warm) > 4 * self.warmup:  # steps failing everywhere: keep no delay
                self._choose()
            return
        per: List[float] = []
        for a, b in pairs:
            ms = self._ms(a, b)
            if ms is None:
                return  # not complete yet: try again at the next exit
            per.append(ms)
        self.step_s = statistics.median(per) / 1e3
        self.delays = [f * self.step_s for f in self.fractions]
        # batches up to idx + depth may be issued already (this step's slot is freed
        # after this call): the trials begin after them
        self.start = idx + self.depth + 1

    def _read_blocks(self, last_exited: int) -> None:
        """Time every block whose steps have all exited and whose events completed."""
        start = self.start
        assert start is not None
        for b in range(len(self.order)):
            if b in self._read:
                continue
            s = start + b * self.block
            end = s + self.timed - 1  # the block's last timed step
            if end > last_exited:
                break
            steps = range(s - 1, end + 1)
            if not all(i in self._events for i in steps):  # a step failed: no sample
                self._read.add(b)
                continue
            ms = self._ms(s - 1, end)
            if ms is None:
                break  # later blocks complete later
            self._read.add(b)
            c = self.order[b]
            self._samples[c].append(ms / self.timed)
            self._cpu_samples[c].append(1e3 * (self._cpu[end] - self._cpu[s - 1]) / self.timed)
        if len(self._read) == len(self.order):
            self._choose()

    def _choose(self) -> None:
        """Keep the candidate with the shortest median step, no delay unless another beats
        it by ``margin``; a candidate with fewer than half its blocks timed is out."""
        need = (self.rounds + 1) // 2
        meds = [statistics.median(s) if len(s) >= need else None for s in self._samples]
        best = 0
        if meds[0] is not None:
            for c, m in enumerate(meds):
                if m is not None and m < (1.0 - self.margin) * meds[0] and m < meds[best]:
                    best = c
        self._medians = meds
        self._cpu_medians = [statistics.median(s) if len(s) >= need else None for s in self._cpu_samples]
        self._events.clear()
        self.chosen_s = self.delays[best] if self.delays is not None else 0.0

    def report(self) -> Optional[Dict[str, Any]]:
        """What the tuning measured (all in ms), or ``None`` while it runs: the warm-up's
        GPU step, the candidate delays, each one's median GPU step and, for comparison,
        its median step on the training thread's clock, and the delay kept."""
        if self.chosen_s is None:
            return None

        def r(x: Optional[float]) -> Optional[float]:
            return None if x is None else round(x, 4)

        return {
            "step_ms": r(None if self.step_s is None else 1e3 * self.step_s),
            "candidates_ms": [round(1e3 * d, 4) for d in (self.delays or [])],
            "gpu_median_step_ms": [r(m) for m in self._medians],
            "cpu_median_step_ms": [r(m) for m in self._cpu_medians],
            "blocks_timed": [len(s) for s in self._samples],
            "chosen_ms": round(1e3 * self.chosen_s, 4),
        }

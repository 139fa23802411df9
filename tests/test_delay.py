"""The prefetch delay (``Pipeline(prefetch_delay=...)``, :mod:`stpipe._delay`): its
validation, the tuner's choice on synthetic step times, and the pipeline with a fixed or
tuned delay (same results as depth 0; the delay is applied; close never waits for it)."""
from __future__ import annotations

import math
import threading
import time
import warnings

import numpy as np
import pytest
import torch

from stpipe import StpipeTypeError, StpipeValueError
from stpipe._delay import FRACTIONS, _DelayTuner, check_delay
from stpipe.embedding import HostEmbedding
from stpipe.pipeline import Pipeline

NUM_ROWS, DIM, BATCH = 500, 4, 12


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("value", ["auto", 0, 0.0, 0.0005, 2, np.float32(0.25), np.int64(1)])
def test_check_delay_accepts(value):
    got = check_delay(value)
    assert got == "auto" if value == "auto" else got == pytest.approx(float(value))


@pytest.mark.parametrize("value", [-1, -1e-9, math.nan, math.inf, "fast", "Auto", ""])
def test_check_delay_rejects_values(value):
    with pytest.raises(StpipeValueError, match="prefetch_delay"):
        check_delay(value)


@pytest.mark.parametrize("value", [True, None, [0.1], {"s": 1}])
def test_check_delay_rejects_types(value):
    with pytest.raises(StpipeTypeError, match="prefetch_delay"):
        check_delay(value)


def test_pipeline_validates_prefetch_delay():
    emb = HostEmbedding(NUM_ROWS, DIM, device="cpu")
    with pytest.raises(ValueError, match="prefetch_delay"):
        Pipeline(emb, prefetch_delay=-0.5)
    with pytest.raises(TypeError, match="prefetch_delay"):
        Pipeline(emb, prefetch_delay=None)


@pytest.mark.parametrize("kw", [dict(fractions=()), dict(fractions=(0.1, 0.2)), dict(warmup=1),
                                dict(block=1), dict(cycles=0)])
def test_tuner_rejects_bad_settings(kw):
    with pytest.raises(StpipeValueError):
        _DelayTuner(**kw)


# ------------------------------------------------------------- the tuner alone
def _drive(tuner, step_time, steps):
    """Simulate steps 1..``steps`` after step 0 (whose end starts the clock, as in a
    run): each takes ``step_time(delay in force)`` seconds. Returns the delays in force,
    ``[d(step 1), d(step 2), ...]``."""
    t = 100.0
    tuner.step_done(t)  # the first end only starts the clock
    seen = []
    for _ in range(steps):
        d = tuner.delay()
        seen.append(d)
        t += step_time(d)
        tuner.step_done(t)
    return seen


def test_tuner_warms_up_with_no_delay_then_measures_the_step():
    tuner = _DelayTuner(warmup=10)
    # steps 1-4 (the first half of the warm-up) do not count; steps 5-9 give the median
    steps = iter([5.0] * 4 + [1.0, 1.2, 0.8, 1.1, 0.9])
    seen = _drive(tuner, lambda d: next(steps, 1.0), 10)
    assert seen[:9] == [0.0] * 9
    assert tuner.step_s == pytest.approx(1.0)
    assert tuner.chosen_s is None and tuner.report() is None


def test_tuner_tries_every_candidate_in_blocks_then_keeps_the_fastest():
    tuner = _DelayTuner(fractions=(0.0, 0.15, 0.3), warmup=10, block=4, cycles=6)
    # a step takes 2 ms, 1.8 ms when its batch was issued 0.3 of a step late
    seen = _drive(tuner, lambda d: 1.8e-3 if d > 0.5e-3 else 2.0e-3, 200)
    trial = seen[9:9 + 4 * 3 * 6]  # steps 10..81
    step = 2.0e-3
    expected_order = [0, 1, 2, 2, 1, 0] * 3
    assert trial == pytest.approx([FRACTIONS[c] * step for c in expected_order for _ in range(4)])
    assert tuner.chosen_s == pytest.approx(0.3 * step)
    assert seen[-1] == pytest.approx(0.3 * step)
    rep = tuner.report()
    assert rep["chosen_ms"] == pytest.approx(0.6)
    assert rep["candidates_ms"] == pytest.approx([0.0, 0.3, 0.6])
    assert rep["median_step_ms"] == pytest.approx([2.0, 2.0, 1.8])


def test_tuner_keeps_no_delay_unless_a_delay_wins_by_the_margin():
    # 1% faster with a delay: below the 2% margin, no delay is kept
    tuner = _DelayTuner(margin=0.02)
    _drive(tuner, lambda d: 0.99e-3 if d > 0 else 1.0e-3, 120)
    assert tuner.chosen_s == 0.0
    # 5% faster: kept
    tuner = _DelayTuner(margin=0.02)
    _drive(tuner, lambda d: 0.95e-3 if d > 0.2e-3 else 1.0e-3, 120)
    assert tuner.chosen_s == pytest.approx(0.3e-3)


def test_tuner_keeps_no_delay_when_delays_are_slower():
    tuner = _DelayTuner()
    rng = np.random.default_rng(0)
    _drive(tuner, lambda d: (1.0e-3 + 2 * d) * (1 + 0.01 * rng.standard_normal()), 150)
    assert tuner.chosen_s == 0.0
    assert tuner.report()["chosen_ms"] == 0.0


def test_tuner_ignores_the_first_step_of_each_block():
    # the first step of a block pays for the previous candidate: a huge time there must
    # not count against the new candidate
    tuner = _DelayTuner(fractions=(0.0, 0.3), warmup=4, block=3, cycles=2)
    calls = {"n": 0}

    def step_time(d):
        calls["n"] += 1
        step = calls["n"]  # steps 1, 2, ...; blocks start at steps 4, 7, 10, ...
        if step >= 4 and (step - 4) % 3 == 0 and d > 0:
            return 1.0  # a block's first step under the delay: an outlier
        return 0.9e-3 if d > 0 else 1.0e-3

    _drive(tuner, step_time, 20)
    assert tuner.chosen_s == pytest.approx(0.3 * 1.0e-3)


# ------------------------------------------------------------- in the pipeline
def _batches(steps=40, seed=0):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(((rng.zipf(1.2, BATCH) - 1) % NUM_ROWS).astype(np.int64)) for _ in range(steps)]


def _train(depth, batches, *, delay="auto", pipe_cls=Pipeline, sleep=0.0):
    emb = HostEmbedding(NUM_ROWS, DIM, device="cpu", generator=torch.Generator().manual_seed(3))
    opt = torch.optim.Adam(emb.parameters(), lr=0.05)
    with pipe_cls(emb, optimizer=opt, depth=depth, prefetch_delay=delay) as pipe:
        for step in pipe.run(batches):
            with step:
                (torch.tanh(emb(step.ids)) ** 2).sum().backward()
                opt.step()
                opt.zero_grad()
                if sleep:
                    time.sleep(sleep)
    out = [emb.table.tensor().clone()] + [t.tensor().clone() for t in emb.state_tables.values()]
    return out, pipe


def _assert_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_auto_on_cpu_is_no_delay():
    _, pipe = _train(1, _batches(30))
    assert pipe.tuning is None
    assert pipe.prefetch_delay_s == 0.0


class _Timed(Pipeline):
    """Records, for each issue, how long after its slot was freed it began."""

    gaps: list

    def _issue(self, flight, run):
        t0 = run.freed.get(flight.slot)
        self.gaps.append(None if t0 is None else time.perf_counter() - t0)
        return super()._issue(flight, run)


@pytest.mark.parametrize("depth", [1, 2])
def test_fixed_delay_is_applied_and_changes_no_result(depth):
    batches = _batches(12)
    ref, _ = _train(0, batches, delay=0.0)
    _Timed.gaps = []
    got, pipe = _train(depth, batches, delay=0.02, pipe_cls=_Timed, sleep=0.03)
    _assert_equal(ref, got)
    assert pipe.prefetch_delay_s == pytest.approx(0.02)
    later = [g for g in _Timed.gaps if g is not None]
    assert len(later) == len(batches) - depth - 1  # the first depth + 1 slots were free
    assert min(later) >= 0.02 - 1e-4, later


def test_depth0_ignores_the_delay():
    batches = _batches(6)
    t0 = time.monotonic()
    _, pipe = _train(0, batches, delay=5.0)
    assert time.monotonic() - t0 < 4.0
    assert pipe.prefetch_delay_s == 0.0


def test_close_does_not_wait_for_a_long_delay():
    emb = HostEmbedding(NUM_ROWS, DIM, device="cpu")
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a prefetch thread left behind would warn
        with Pipeline(emb, optimizer=opt, depth=1, prefetch_delay=60.0) as pipe:
            for step in pipe.run(_batches(10)):
                with step:
                    emb(step.ids).sum().backward()
                    opt.step()
                if step.index == 1:  # batch 2 waits 60 s to be issued
                    break
    assert time.monotonic() - t0 < 5.0
    deadline = time.monotonic() + 2.0
    while any(t.name.startswith("stpipe-prefetch") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "prefetch thread still running"
        time.sleep(0.01)


def test_auto_tuner_runs_in_the_pipeline(monkeypatch):
    """CPU has no tuner by default; with one forced in (small settings), the pipeline
    feeds it every successful step, applies its delays and reports its choice, and the
    results stay those of depth 0."""
    made = []

    def small(self):
        t = _DelayTuner(fractions=(0.0, 0.5), warmup=4, block=2, cycles=2)
        made.append(t)
        return t

    monkeypatch.setattr(Pipeline, "_make_tuner", small)
    batches = _batches(24)
    ref, _ = _train(0, batches, delay=0.0)
    got, pipe = _train(1, batches, sleep=0.002)
    _assert_equal(ref, got)
    assert len(made) == 1 and made[0]._done == len(batches)
    rep = pipe.tuning
    assert rep is not None
    assert rep["chosen_ms"] in rep["candidates_ms"]
    assert rep["step_ms"] > 2.0  # each step slept 2 ms
    assert pipe.prefetch_delay_s == pytest.approx(rep["chosen_ms"] / 1e3, abs=1e-7)


def test_failed_steps_free_slots_but_are_not_timed(monkeypatch):
    made = []
    monkeypatch.setattr(Pipeline, "_make_tuner",
                        lambda self: made.append(_DelayTuner(warmup=4, block=2, cycles=1)) or made[-1])
    emb = HostEmbedding(NUM_ROWS, DIM, device="cpu")
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    with Pipeline(emb, optimizer=opt, depth=1) as pipe:
        for step in pipe.run(_batches(10)):
            try:
                with step:
                    emb(step.ids).sum().backward()
                    opt.step()
                    if step.index % 3 == 0:
                        raise KeyError("boom")
            except KeyError:
                pass
    assert made[0]._done == 10 - 4  # steps 0, 3, 6, 9 failed
    assert pipe.stats["failed"] == 4


def test_slots_never_used_are_not_delayed():
    # depth 1 has two slots: both batches take a slot no step has freed yet, so even a
    # long delay is never waited for (a fast first step must not hold batch 1 back)
    t0 = time.monotonic()
    got, pipe = _train(1, _batches(2), delay=60.0)
    assert time.monotonic() - t0 < 5.0
    assert pipe.stats["steps"] == 2

"""``Pipeline(prefetch_delay=...)``: its validation; a delay is applied after the slot a
batch takes was freed (never for slots not yet used), changes no result, and close never
waits for it; the ``"auto"`` default's rule (:func:`stpipe.pipeline._auto_delay`) and
where it waits."""
from __future__ import annotations

import math
import threading
import time
import warnings

import numpy as np
import pytest
import torch

from stpipe import StpipeTypeError, StpipeValueError
from stpipe.embedding import HostEmbedding
from stpipe.pipeline import Pipeline, _auto_delay

NUM_ROWS, DIM, BATCH = 500, 4, 12


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("value", [0, 0.0, 0.0005, 2, np.float32(0.25), np.int64(1)])
def test_prefetch_delay_accepts_seconds(value):
    pipe = Pipeline(HostEmbedding(NUM_ROWS, DIM, device="cpu"), prefetch_delay=value)
    assert pipe.prefetch_delay == pytest.approx(float(value))
    assert isinstance(pipe.prefetch_delay, float)


@pytest.mark.parametrize("value", [-1, -1e-9, math.nan, math.inf, "0.1", "AUTO", ""])
def test_prefetch_delay_rejects_values(value):
    with pytest.raises(StpipeValueError, match="prefetch_delay must be seconds >= 0"):
        Pipeline(HostEmbedding(NUM_ROWS, DIM, device="cpu"), prefetch_delay=value)


@pytest.mark.parametrize("value", [True, None, b"auto", [0.1]])
def test_prefetch_delay_rejects_types(value):
    with pytest.raises(StpipeTypeError, match="prefetch_delay must be a number of seconds or 'auto'"):
        Pipeline(HostEmbedding(NUM_ROWS, DIM, device="cpu"), prefetch_delay=value)


def test_prefetch_delay_defaults_to_auto():
    pipe = Pipeline(HostEmbedding(NUM_ROWS, DIM, device="cpu"))
    assert pipe.prefetch_delay == "auto"
    assert Pipeline(HostEmbedding(NUM_ROWS, DIM, device="cpu"), prefetch_delay="auto").prefetch_delay == "auto"


# ------------------------------------------------------------ the "auto" rule
def test_auto_delay_is_zero_without_history():
    assert _auto_delay([], []) == 0.0
    assert _auto_delay([], [0.001]) == 0.0


def test_auto_delay_is_a_fraction_of_the_step_period():
    # period 3 ms, issue 0.7 ms: 0.3 of the period (0.9 ms) leaves the issue time to spare
    assert _auto_delay([0.003] * 8, [0.0007] * 8) == pytest.approx(0.0009)
    assert _auto_delay([0.010], []) == pytest.approx(0.003)


def test_auto_delay_takes_medians():
    # one slow step (a checkpoint, a log line) and one slow issue do not move it
    assert _auto_delay([0.003, 0.003, 0.5, 0.003, 0.003], [0.0007, 0.2, 0.0007]) == pytest.approx(0.0009)
    assert _auto_delay([0.002, 0.004], []) == pytest.approx(0.3 * 0.003)


def test_auto_delay_leaves_the_issue_time_to_finish():
    # period 3 ms, issue 2.4 ms: 0.9 * 3 - 2.4 = 0.3 ms, less than 0.3 of the period
    assert _auto_delay([0.003] * 4, [0.0024] * 4) == pytest.approx(0.0003)
    # an issue that takes most of a step: no wait at all
    assert _auto_delay([0.003] * 4, [0.0029] * 4) == 0.0
    assert _auto_delay([0.003] * 4, [0.01] * 4) == 0.0


# ------------------------------------------------------------- in the pipeline
def _batches(steps=40, seed=0):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(((rng.zipf(1.2, BATCH) - 1) % NUM_ROWS).astype(np.int64)) for _ in range(steps)]


def _train(depth, batches, *, delay=0.0, pipe_cls=Pipeline, sleep=0.0, fail_at=()):
    emb = HostEmbedding(NUM_ROWS, DIM, device="cpu", generator=torch.Generator().manual_seed(3))
    opt = torch.optim.Adam(emb.parameters(), lr=0.05)
    with pipe_cls(emb, optimizer=opt, depth=depth, prefetch_delay=delay) as pipe:
        for step in pipe.run(batches):
            try:
                with step:
                    (torch.tanh(emb(step.ids)) ** 2).sum().backward()
                    opt.step()
                    opt.zero_grad()
                    if sleep:
                        time.sleep(sleep)
                    if step.index in fail_at:
                        raise KeyError("boom")
            except KeyError:
                pass
    out = [emb.table.tensor().clone()] + [t.tensor().clone() for t in emb.state_tables.values()]
    return out, pipe


def _assert_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


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
    later = [g for g in _Timed.gaps if g is not None]
    assert len(later) == len(batches) - depth - 1  # the first depth + 1 slots were free
    assert min(later) >= 0.02 - 1e-4, later


class _AutoOnCpu(_Timed):
    """``"auto"`` waits here as it does on CUDA (on CPU it does not by default)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self._auto_waits = True


@pytest.mark.parametrize("depth", [1, 2])
def test_auto_delay_waits_and_changes_no_result(depth):
    batches = _batches(14)
    ref, _ = _train(0, batches)
    _Timed.gaps = []
    got, pipe = _train(depth, batches, delay="auto", pipe_cls=_AutoOnCpu, sleep=0.03)
    _assert_equal(ref, got)
    assert pipe.prefetch_delay == "auto"
    # steps of >= 30 ms: once two frees give a period, each issue waits about 0.3 of it
    assert pipe.stats["delayed_s"] > 0.005 * (len(batches) - depth - 3)
    later = [g for g in _Timed.gaps if g is not None][2:]
    assert later and min(later) >= 0.3 * 0.03 - 1e-3, later


def test_auto_does_not_wait_on_cpu():
    batches = _batches(10)
    ref, _ = _train(0, batches)
    got, pipe = _train(1, batches, delay="auto", sleep=0.01)
    _assert_equal(ref, got)
    assert pipe.stats["delayed_s"] == 0.0


def test_depth0_ignores_the_delay():
    batches = _batches(6)
    t0 = time.monotonic()
    _train(0, batches, delay=5.0)
    assert time.monotonic() - t0 < 4.0


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


def test_slots_never_used_are_not_delayed():
    # depth 1 has two slots: both batches take a slot no step has freed yet, so even a
    # long delay is never waited for (a fast first step must not hold batch 1 back)
    t0 = time.monotonic()
    got, pipe = _train(1, _batches(2), delay=60.0)
    assert time.monotonic() - t0 < 5.0
    assert pipe.stats["steps"] == 2


@pytest.mark.parametrize("depth", [1, 2])
def test_failed_steps_under_a_delay(depth):
    # a failed step frees its slot too; the batch issued into it waits as after any step
    batches = _batches(10)
    ref, _ = _train(0, batches, fail_at=(2, 3, 7))
    got, pipe = _train(depth, batches, delay=0.005, fail_at=(2, 3, 7))
    _assert_equal(ref, got)
    assert pipe.stats["failed"] == 3 and pipe.stats["steps"] == 7

"""``Pipeline(prefetch_delay="auto")``: the tuner (:mod:`stpipe._delay`) against a
simulated GPU clock, and its use in the pipeline (on CPU, with fake events)."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from stpipe import StpipeValueError
from stpipe._delay import _DelayTuner
from stpipe.embedding import HostEmbedding
from stpipe.pipeline import Pipeline

MS = 1e-3


class _Ev:
    """A fake CUDA event: completes at GPU time ``t`` (ms), ready once ``clock.now >= t``."""

    def __init__(self, clock, t):
        self.clock, self.t = clock, t

    def query(self):
        return self.clock.done >= self.t

    def elapsed_time(self, end):
        assert self.query() and end.query(), "elapsed_time on an event not completed"
        return end.t - self.t


class _Gpu:
    """Step costs by delay; ``lag``: how far (ms) the GPU's completions trail its work."""

    def __init__(self, lag=0.0):
        self.t = 0.0  # GPU time at the end of the work queued so far (ms)
        self.lag = lag
        self.done = 0.0  # GPU time completed so far

    def record(self, stream):
        return _Ev(self, self.t)


def _simulate(tuner, gpu, steps, gpu_ms, cpu_ms, depth=1, skip=()):
    """Drive ``tuner`` as a pipeline would: batch ``i + depth + 1`` is issued after step
    ``i`` frees its slot. A step's cost depends on the delay of its own batch and of the
    batch issued during it (``gpu_ms(d_own, d_issued)`` ms, likewise ``cpu_ms``)."""
    issued = {i: tuner.delay_for(i) for i in range(depth + 1)}
    cpu = 0.0
    for idx in range(steps):
        own, during = issued[idx], issued[idx + depth]
        gpu.t += gpu_ms(own, during)
        gpu.done = max(gpu.done, gpu.t - gpu.lag)
        cpu += cpu_ms(own, during)
        if idx not in skip:  # a failed step records nothing
            tuner.step_done(idx, None, cpu * MS)
        issued[idx + depth + 1] = tuner.delay_for(idx + depth + 1)
    return issued


def _by_delay(costs, step_ms):
    """``costs[k]``: the cost of candidate ``k`` (delay ``k * 0.1 * step``), averaged over
    the step's own batch and the batch issued during it."""
    def f(d_own, d_issued):
        k = [round(d / (0.1 * step_ms * MS)) for d in (d_own, d_issued)]
        return 0.5 * (costs[k[0]] + costs[k[1]])
    return f


def _flat(ms):
    return lambda d_own, d_issued: ms


# ------------------------------------------------------------------ choosing
def test_chooses_the_fastest_delay_on_the_gpu_clock_not_the_cpu_clock():
    gpu = _Gpu()
    tuner = _DelayTuner(1, gpu.record)
    # the GPU is fastest at 0.2 x step; the training thread's clock favours 0.3 x step
    # (it runs ahead while the GPU falls behind): the tuner must follow the GPU
    gpu_cost = lambda own, dur: 2.0 if own == 0 and dur == 0 else _by_delay([2.0, 1.9, 1.7, 2.3], 2.0)(own, dur)
    cpu_cost = lambda own, dur: 2.0 - 1000 * dur  # larger delays look faster
    issued = _simulate(tuner, gpu, 200, gpu_cost, cpu_cost)
    assert tuner.done
    rep = tuner.report()
    assert rep["step_ms"] == pytest.approx(2.0)
    assert rep["candidates_ms"] == pytest.approx([0.0, 0.2, 0.4, 0.6])
    assert rep["chosen_ms"] == pytest.approx(0.4)
    assert tuner.chosen_s == pytest.approx(0.4 * MS)
    assert rep["gpu_median_step_ms"] == pytest.approx([2.0, 1.9, 1.7, 2.3])
    assert min(range(4), key=lambda c: rep["cpu_median_step_ms"][c]) == 3
    assert rep["blocks_timed"] == [6, 6, 6, 6]
    # every candidate was issued; after the choice every batch gets the chosen delay
    assert {round(d / MS, 6) for d in issued.values()} == {0.0, 0.2, 0.4, 0.6}
    assert issued[199] == pytest.approx(0.4 * MS)


def test_keeps_no_delay_unless_another_is_faster_by_the_margin():
    gpu = _Gpu()
    tuner = _DelayTuner(1, gpu.record)
    _simulate(tuner, gpu, 200, _by_delay([2.0, 1.99, 1.985, 2.2], 2.0), _flat(2.0))
    assert tuner.done and tuner.chosen_s == 0.0  # 0.75% faster is below the 2% margin
    assert tuner.report()["chosen_ms"] == 0.0


def test_all_delays_slower_keeps_none():
    gpu = _Gpu()
    tuner = _DelayTuner(1, gpu.record)
    _simulate(tuner, gpu, 200, _by_delay([2.0, 2.1, 2.2, 2.4], 2.0), _flat(2.0))
    assert tuner.chosen_s == 0.0


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_blocks_time_only_steps_fully_under_their_candidate(depth):
    # a block's timed steps are those whose own batch and the batch issued during them
    # share the block's delay: a cost that depends on either must be measured exactly
    gpu = _Gpu()
    tuner = _DelayTuner(depth, gpu.record)
    _simulate(tuner, gpu, 300, _by_delay([3.0, 2.5, 2.8, 3.3], 3.0), _flat(3.0), depth=depth)
    rep = tuner.report()
    assert rep["gpu_median_step_ms"] == pytest.approx([3.0, 2.5, 2.8, 3.3])
    assert rep["chosen_ms"] == pytest.approx(0.3)


def test_trials_start_after_batches_already_issued():
    gpu = _Gpu()
    tuner = _DelayTuner(1, gpu.record, warmup=5)
    issued = _simulate(tuner, gpu, 12, _flat(2.0), _flat(2.0))
    # the step time was known at step 4's exit; batches up to 5 may have been issued by
    # then, so the trials begin at batch 6 (0.0 for every earlier one)
    assert tuner.start == 6
    assert all(issued[i] == 0.0 for i in range(6))
    # blocks of timed + depth = 5 batches: 6-10 under no delay, 11-15 under 0.1 x step
    assert [tuner.delay_for(i) for i in (6, 10, 11, 15, 16)] == pytest.approx([0.0, 0.0, 0.2 * MS, 0.2 * MS, 0.4 * MS])


def test_waits_for_events_to_complete_before_judging():
    gpu = _Gpu(lag=1e9)  # nothing completes
    tuner = _DelayTuner(1, gpu.record)
    issued = _simulate(tuner, gpu, 200, _by_delay([2.0, 1.5, 2.0, 2.0], 2.0), _flat(2.0))
    assert tuner.start is None and not tuner.done and tuner.report() is None
    assert set(issued.values()) == {0.0}  # no step time yet: no trials
    gpu.lag = 0.0
    gpu.done = gpu.t
    tuner.step_done(200, None, 1.0)  # the next exit reads them
    assert tuner.start == 202 and not tuner.done


def test_choice_waits_for_the_last_blocks_events():
    gpu = _Gpu(lag=30.0)  # completions trail the queued work by 15 steps
    tuner = _DelayTuner(1, gpu.record)
    _simulate(tuner, gpu, 160, _by_delay([2.0, 1.5, 2.0, 2.0], 2.0), _flat(2.0))
    assert tuner.start is not None
    trial_end = tuner.start + tuner.block * len(tuner.order)
    assert trial_end <= 160 and tuner.done
    rep = tuner.report()
    assert rep["chosen_ms"] == pytest.approx(0.2)
    # between the trials' end and the choice, batches got no delay
    assert tuner.delay_for(10**6) == pytest.approx(0.2 * MS)


def test_blocks_with_a_failed_step_are_dropped():
    gpu = _Gpu()
    tuner = _DelayTuner(1, gpu.record, warmup=4, rounds=4)
    # warm-up: steps 0-3, step time known at 3, trials from batch 5, blocks of 5 batches:
    # block b times steps 5b+5 .. 5b+8 (spanning from the exit of 5b+4)
    fail = {6, 11, 17}  # blocks 0, 1 and 2
    _simulate(tuner, gpu, 150, _by_delay([2.0, 1.5, 2.0, 2.0], 2.0), _flat(2.0), skip=fail)
    rep = tuner.report()
    assert tuner.start == 5
    assert sum(rep["blocks_timed"]) == 16 - 3
    assert rep["chosen_ms"] == pytest.approx(0.2)


def test_a_candidate_with_too_few_blocks_is_out():
    gpu = _Gpu()
    tuner = _DelayTuner(1, gpu.record, warmup=4, rounds=2)
    # blocks 1 (0.2 x step, the fastest) and 6 (0.2 x step again: round 2 rotates by 1)
    order = tuner.order
    assert [b for b, c in enumerate(order) if c == 1] == [1, 4]
    fail = {5 + 5 * 1 + 1, 5 + 5 * 4 + 1}  # one step in each of the two blocks
    _simulate(tuner, gpu, 100, _by_delay([2.0, 1.0, 1.9, 2.0], 2.0), _flat(2.0), skip=fail)
    rep = tuner.report()
    assert rep["blocks_timed"][1] == 0 and rep["gpu_median_step_ms"][1] is None
    assert rep["chosen_ms"] == pytest.approx(0.4)  # the fastest with its blocks timed


def test_failing_warmup_gives_up_on_no_delay():
    gpu = _Gpu()
    tuner = _DelayTuner(1, gpu.record, warmup=4)
    fail = set(range(1, 100, 2))  # never two consecutive successful steps
    _simulate(tuner, gpu, 100, _flat(2.0), _flat(2.0), skip=fail)
    assert tuner.done and tuner.chosen_s == 0.0
    assert tuner.report()["step_ms"] is None


@pytest.mark.parametrize("kw, match", [
    ({"fractions": ()}, "fractions must start with 0.0"),
    ({"fractions": (0.1, 0.2)}, "fractions must start with 0.0"),
    ({"fractions": (0.0, -0.1)}, "fractions must start with 0.0 and be >= 0"),
    ({"fractions": (0.0, float("nan"))}, "fractions must start with 0.0 and be >= 0"),
    ({"depth": 0}, "expected depth >= 1"),
    ({"warmup": 2}, "got 1, 2, 4, 6"),
    ({"timed": 0}, "got 1, 10, 0, 6"),
    ({"rounds": 0}, "got 1, 10, 4, 0"),
])
def test_bad_settings_are_rejected(kw, match):
    args = {"depth": 1, **kw}
    depth = args.pop("depth")
    with pytest.raises(StpipeValueError, match=match):
        _DelayTuner(depth, lambda s: None, **args)


def test_rounds_rotate_the_candidates():
    tuner = _DelayTuner(1, lambda s: None, rounds=4)
    assert tuner.order == [0, 1, 2, 3, 1, 2, 3, 0, 2, 3, 0, 1, 3, 0, 1, 2]


# ------------------------------------------------------------- in the pipeline
NUM_ROWS, DIM, BATCH = 400, 4, 10


def _batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(((rng.zipf(1.2, BATCH) - 1) % NUM_ROWS).astype(np.int64)) for _ in range(steps)]


class _FakeEv:
    def __init__(self):
        self.t = time.perf_counter()

    def query(self):
        return True

    def elapsed_time(self, end):
        return 1e3 * (end.t - self.t)


class _Tuned(Pipeline):
    """A pipeline whose ``"auto"`` tunes on CPU, timing by ``perf_counter`` events, with a
    short schedule; it notes the delay asked for each batch."""

    asked: list

    def _make_tuner(self):
        tuner = _DelayTuner(self.depth, lambda stream: _FakeEv(), warmup=4, timed=2, rounds=2,
                            fractions=(0.0, 0.5))
        real = tuner.delay_for

        def delay_for(idx):
            d = real(idx)
            self.asked.append((idx, d))
            return d
        tuner.delay_for = delay_for
        return tuner


def _train(depth, batches, *, delay=0.0, pipe_cls=Pipeline, fail_at=(), pipe=None, emb=None, opt=None):
    if pipe is None:
        emb = HostEmbedding(NUM_ROWS, DIM, device="cpu", generator=torch.Generator().manual_seed(5))
        opt = torch.optim.Adam(emb.parameters(), lr=0.05)
        pipe = pipe_cls(emb, optimizer=opt, depth=depth, prefetch_delay=delay)
    for step in pipe.run(batches):
        try:
            with step:
                (torch.tanh(emb(step.ids)) ** 2).sum().backward()
                opt.step()
                opt.zero_grad()
                time.sleep(0.002)
                if step.index in fail_at:
                    raise KeyError("boom")
        except KeyError:
            pass
    pipe.synchronize()
    out = [emb.table.tensor().clone()] + [t.tensor().clone() for t in emb.state_tables.values()]
    return out, pipe, emb, opt


def _assert_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_auto_on_cpu_is_no_delay():
    batches = _batches(20)
    ref, *_ = _train(0, batches)
    got, pipe, *_ = _train(1, batches, delay="auto")
    _assert_equal(ref, got)
    assert pipe.prefetch_delay == "auto"
    assert pipe.tuning is None and pipe.prefetch_delay_s == 0.0
    pipe.close()


@pytest.mark.parametrize("depth", [1, 2])
def test_auto_tunes_changes_no_result_and_keeps_its_choice(depth):
    batches = _batches(60)
    _Tuned.asked = []
    got, pipe, emb, opt = _train(depth, batches, delay="auto", pipe_cls=_Tuned, fail_at=(3, 30))
    rep = pipe.tuning
    assert rep is not None, "the tuning did not finish in 60 steps"
    assert rep["candidates_ms"][0] == 0.0 and rep["candidates_ms"][1] > 0.0
    tuner = pipe._tuner
    # the trials asked for both candidates
    assert {d for _, d in _Tuned.asked} >= {0.0, tuner.delays[1]}
    assert pipe.prefetch_delay_s == tuner.chosen_s
    # a second run keeps the choice: no new tuning, every batch asks for the chosen delay
    _Tuned.asked = []
    got, pipe, emb, opt = _train(depth, batches, pipe=pipe, emb=emb, opt=opt, fail_at=(30,))
    assert pipe._tuner is tuner
    assert _Tuned.asked and {d for _, d in _Tuned.asked} == {tuner.chosen_s}
    pipe.close()
    # two runs with a failed step in each, against one sequential run over both
    ref, *_ = _train(0, batches + batches, fail_at=(3, 30, 60 + 30))
    _assert_equal(ref, got)


def test_an_unfinished_tuning_starts_again_in_the_next_run():
    batches = _batches(6)
    _Tuned.asked = []
    _, pipe, emb, opt = _train(1, batches, delay="auto", pipe_cls=_Tuned)
    first = pipe._tuner
    assert first is not None and not first.done and pipe.tuning is None
    _train(1, batches, pipe=pipe, emb=emb, opt=opt)
    assert pipe._tuner is not first
    pipe.close()


def test_depth0_auto_has_no_tuner():
    _, pipe, *_ = _train(0, _batches(8), delay="auto", pipe_cls=_Tuned)
    assert pipe._tuner is None and pipe.tuning is None and pipe.prefetch_delay_s == 0.0
    pipe.close()

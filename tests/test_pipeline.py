"""Pipeline tests: pipelined (depth 1, 2) vs sequential (depth 0), bit for bit.

Every optimizer of the issue x adversarial id patterns; the loss depends on the current row
values, so a stale row (the hazard) changes the result. A control test switches the
hazard fix-up off and checks that the comparison then fails. Failure tests: an exception
in the user's step, in the batch iterable, in the prefetch thread (injected), bad ids; the
tables are unchanged for the failed step and nothing hangs.
"""
from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest
import torch

import stpipe.pipeline as pipeline_mod
from stpipe import StpipeIndexError, StpipeRuntimeError, StpipeTypeError, StpipeValueError
from stpipe.embedding import HostEmbedding
from stpipe.pipeline import Pipeline, Step

NUM_ROWS = 1000
DIM = 8
STEPS = 20
BATCH = 16

# --------------------------------------------------------------------------- fixtures
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "sgd_momentum_dampening": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.3,
                                                        weight_decay=0.01),
    "sgd_foreach": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5, foreach=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5, fused=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True, weight_decay=0.01),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=0.01, foreach=True),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
    "adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "nadam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "radam": lambda p: torch.optim.RAdam(p, lr=0.01),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1, lr_decay=0.01),
    "adagrad_fused": lambda p: torch.optim.Adagrad(p, lr=0.1, fused=True),
    "adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
    "rmsprop_centered_momentum": lambda p: torch.optim.RMSprop(p, lr=0.01, centered=True, momentum=0.9),
    "rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
    "asgd": lambda p: torch.optim.ASGD(p, lr=0.05, t0=5),
}


def _zipf(rng, n):
    return (rng.zipf(1.2, size=n) - 1) % NUM_ROWS


PATTERNS = {
    "identical": lambda rng, i: np.arange(10, 10 + BATCH) % 13,
    "alternating": lambda rng, i: (np.arange(BATCH) + (0 if i % 2 else 5)) % 20,
    "sliding": lambda rng, i: np.arange(4 * i, 4 * i + BATCH),
    "hot": lambda rng, i: np.concatenate([[7], rng.integers(0, 60, BATCH - 1)]),
    "all_same": lambda rng, i: np.full(BATCH, 3),
    "empty": lambda rng, i: np.empty(0, np.int64) if i % 3 == 1 else rng.integers(0, 40, BATCH),
    "zipf": lambda rng, i: _zipf(rng, BATCH),
}


def make_batches(pattern, steps=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(steps):
        ids = np.asarray(PATTERNS[pattern](rng, i), dtype=np.int64)
        out.append({"ids": torch.from_numpy(ids), "target": torch.from_numpy(rng.standard_normal(ids.shape[0]))})
    return out


COEF = torch.linspace(-1.0, 1.0, DIM)


def loss_fn(rows, target):
    """Depends on the rows' current values, so stale rows change the result."""
    pred = (torch.tanh(rows) * COEF).sum(-1)
    return ((pred - target.to(rows.dtype)) ** 2).sum()


def make_emb(seed=1, **kw):
    return HostEmbedding(NUM_ROWS, DIM, generator=torch.Generator().manual_seed(seed), device="cpu", **kw)


def snapshot(emb, opt=None):
    out = {"table": emb.table.tensor().clone()}
    for key, t in emb.state_tables.items():
        out["state:" + key] = t.tensor().clone()
    if opt is not None and emb.weight in opt.state:
        for key, v in opt.state[emb.weight].items():
            if key not in emb.state_tables:
                out["scalar:" + key] = v.clone() if torch.is_tensor(v) else v
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if torch.is_tensor(x):
            assert torch.equal(x, y), f"{key} differs (max abs diff {(x.double() - y.double()).abs().max()})"
        else:
            assert x == y, key


def train(depth, opt_name, batches, *, fail_at=(), skip=(), emb_kw=None):
    emb = make_emb(**(emb_kw or {}))
    opt = OPTIMIZERS[opt_name](emb.parameters())
    with Pipeline(emb, optimizer=opt, ids=lambda b: b["ids"], depth=depth) as pipe:
        for step in pipe.run(b for i, b in enumerate(batches) if i not in skip):
            try:
                with step:
                    loss = loss_fn(emb(step.ids), step.batch["target"])
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    if step.index in fail_at:
                        raise KeyError("boom")
            except KeyError:
                pass
    return snapshot(emb, opt), pipe


# ------------------------------------------------------------ pipelined == sequential
# fused CPU kernels are slow on tiny tensors: they get the three hardest patterns
MATRIX = [
    pytest.param(o, p, id=f"{o}-{p}")
    for o in OPTIMIZERS
    for p in PATTERNS
    if "fused" not in o or p in ("identical", "hot", "zipf")
]


@pytest.mark.parametrize("opt_name, pattern", MATRIX)
def test_pipelined_equals_sequential(opt_name, pattern):
    batches = make_batches(pattern)
    ref, _ = train(0, opt_name, batches)
    for depth in (1, 2):
        got, pipe = train(depth, opt_name, batches)
        assert_same(ref, got)
        assert pipe.stats["steps"] == STEPS and pipe.stats["failed"] == 0
    if pattern != "empty" and opt_name != "sgd":
        assert len(ref) > 1  # optimizer state was offloaded and compared


def test_training_changes_rows():
    """Guard against a vacuous comparison: training moves the table."""
    batches = make_batches("hot")
    before = make_emb().table.tensor().clone()
    got, _ = train(1, "adam", batches)
    assert not torch.equal(before, got["table"])


@pytest.mark.parametrize("depth", [1, 2], ids=lambda d: f"depth{d}")
def test_hazard_fixup_is_needed(depth, monkeypatch):
    """Control: without the device-to-device fix-up the pipelined result differs."""
    batches = make_batches("identical")
    ref, _ = train(0, "adam", batches)

    orig_issue = Pipeline._issue

    def no_overlaps(self, flight, run):
        orig_issue(self, flight, run)
        flight.overlaps.clear()

    monkeypatch.setattr(Pipeline, "_issue", no_overlaps)
    got, _ = train(depth, "adam", batches)
    assert not torch.equal(ref["table"], got["table"])


def test_stale_rows_are_carried():
    _, pipe = train(1, "adam", make_batches("identical"))
    assert pipe.stats["rows_carried"] > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_half_dtypes_pipelined_equals_sequential(dtype):
    batches = make_batches("zipf")
    ref, _ = train(0, "adam", batches, emb_kw={"dtype": dtype})
    got, _ = train(2, "adam", batches, emb_kw={"dtype": dtype})
    assert ref["table"].dtype == dtype
    assert_same(ref, got)


# ------------------------------------------------------------------- several tables
def _skipgram_batches(steps=20, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        centre = torch.from_numpy(_zipf(rng, 8))
        ctx = torch.from_numpy(_zipf(rng, (8, 5)).reshape(8, 5))
        out.append({"centre": centre, "ctx": ctx, "label": torch.from_numpy(rng.integers(0, 2, (8, 5))).float()})
    return out


def _train_skipgram(depth, batches, shared=False):
    e_in = make_emb(seed=2)
    e_out = e_in if shared else make_emb(seed=3)
    params = list(e_in.parameters()) + ([] if shared else list(e_out.parameters()))
    opt = torch.optim.Adam(params, lr=0.01)
    if shared:
        pipe = Pipeline(e_in, optimizer=opt, ids=lambda b: (b["centre"], b["ctx"]), depth=depth)
    else:
        pipe = Pipeline({"in": e_in, "out": e_out}, optimizer=opt,
                        ids=lambda b: {"in": b["centre"], "out": b["ctx"]}, depth=depth)
    with pipe:
        for step in pipe.run(batches):
            with step:
                if shared:
                    c, x = step.ids
                    u, v = e_in(c), e_in(x)
                else:
                    u, v = e_in(step.ids["in"]), e_out(step.ids["out"])
                logits = (u.unsqueeze(1) * v).sum(-1)
                loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, step.batch["label"])
                loss.backward()
                opt.step()
                opt.zero_grad()
    out = {"in": snapshot(e_in, opt)}
    if not shared:
        out["out"] = snapshot(e_out, opt)
    return out


@pytest.mark.parametrize("shared", [False, True], ids=["two_tables", "one_table_two_fields"])
def test_several_tables(shared):
    batches = _skipgram_batches()
    ref = _train_skipgram(0, batches, shared)
    for depth in (1, 2):
        got = _train_skipgram(depth, batches, shared)
        for name in ref:
            assert_same(ref[name], got[name])


def test_ids_variants():
    e_a, e_b = make_emb(seed=4), make_emb(seed=5)
    batches = [{"a": torch.tensor([1, 2]), "b": torch.tensor([3])}] * 3
    for ids in (None, {"a": "a", "b": lambda b: b["b"]}, lambda b: {"a": b["a"], "b": b["b"]}):
        with Pipeline({"a": e_a, "b": e_b}, ids=ids) as pipe:
            seen = []
            for step in pipe.run(batches):
                with step:
                    seen.append((step.plans["a"].unique.tolist(), step.plans["b"].unique.tolist()))
                    assert e_a(step.ids["a"]).shape == (2, DIM)
        assert seen == [([1, 2], [3])] * 3
    # single table: key, callable, raw batch
    for ids, data in (("x", [{"x": [4, 5]}]), (None, [np.array([4, 5])]), (lambda b: b[0], [([4, 5],)])):
        with Pipeline(e_a, ids=ids) as pipe:
            for step in pipe.run(data):
                with step:
                    assert step.plans[None].unique.tolist() == [4, 5]


def test_ids_function_must_name_every_table():
    e_a, e_b = make_emb(), make_emb()
    with Pipeline({"a": e_a, "b": e_b}, ids=lambda b: {"a": b}, depth=0) as pipe:
        with pytest.raises(StpipeValueError, match=r"no ids for table\(s\) \['b'\]"):
            for _ in pipe.run([[1]]):
                pass


def test_constructor_validation():
    emb = make_emb()
    opt_other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(StpipeValueError, match="depth"):
        Pipeline(emb, depth=-1)
    with pytest.raises(TypeError, match="HostEmbedding"):
        Pipeline(torch.nn.Embedding(3, 2))
    with pytest.raises(StpipeValueError, match="none of the given optimizers"):
        Pipeline(emb, optimizer=opt_other)
    with pytest.raises(StpipeValueError, match="twice"):
        Pipeline({"a": emb, "b": emb})
    # two embeddings over one HostTable: each would carry and write back the shared rows
    # on its own (depth 1 then differs from depth 0); tied weights are one table instead
    with pytest.raises(StpipeValueError, match="'a' and 'b' wrap the same HostTable"):
        Pipeline({"a": emb, "b": HostEmbedding(table=emb.table)})


def test_dataloader_iterator_and_profile():
    data = torch.utils.data.TensorDataset(torch.randint(0, NUM_ROWS, (64, 4)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    emb = make_emb()
    opt = torch.optim.Adagrad(emb.parameters(), lr=0.1)
    with Pipeline(emb, optimizer=opt, ids=lambda b: b[0], profile=True) as pipe:
        n = 0
        for step in pipe.run(iter(loader)):
            with step:
                emb(step.ids).sum().backward()
                opt.step()
                opt.zero_grad()
            n += 1
    assert n == 8
    assert len(pipe.profile) == 8
    assert {"plan_ms", "wait_ms", "compute_ms", "writeback_ms"} <= pipe.profile[0].keys()


def test_forward_with_other_ids_inside_step():
    emb = make_emb()
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    with Pipeline(emb, optimizer=opt, depth=1) as pipe:
        for step in pipe.run([torch.tensor([5, 9, 5, 11])]):
            with step:
                same = emb(step.ids)
                again = emb(step.ids.clone())  # not the planned object: located by search
                assert torch.equal(same, again)
                assert torch.equal(emb(torch.tensor([11, 5])), same[[3, 0]])
                with pytest.raises(StpipeValueError, match="row id 12 at position 1"):
                    emb(torch.tensor([9, 12]))


# --------------------------------------------------------------------------- failures
DEPTHS = pytest.mark.parametrize("depth", [0, 1, 2], ids=lambda d: f"depth{d}")


@DEPTHS
@pytest.mark.parametrize("opt_name", ["adam", "asgd", "rprop"])
def test_exception_in_step_leaves_tables_and_goes_on(depth, opt_name):
    """A failed step writes nothing and restores scalar state: as if the batch never was."""
    batches = make_batches("hot")
    for fail in ((0,), (5,), (5, 6), (STEPS - 1,)):
        ref, _ = train(0, opt_name, batches, skip=fail)
        got, pipe = train(depth, opt_name, batches, fail_at=fail)
        assert_same(ref, got)
        assert pipe.stats["failed"] == len(fail)


@DEPTHS
def test_tables_unchanged_right_after_failed_step(depth):
    emb = make_emb()
    opt = torch.optim.Adam(emb.parameters(), lr=0.1)
    batches = make_batches("identical", steps=8)
    with Pipeline(emb, optimizer=opt, ids="ids", depth=depth) as pipe:
        for step in pipe.run(batches):
            pipe.synchronize()
            before = snapshot(emb, opt)
            try:
                with step:
                    loss_fn(emb(step.ids), step.batch["target"]).backward()
                    opt.step()
                    if step.index >= 3:
                        1 / 0
            except ZeroDivisionError:
                assert step.index >= 3
            pipe.synchronize()
            after = snapshot(emb, opt)
            if step.index >= 3:
                assert_same(before, after)
            else:
                assert not torch.equal(before["table"], after["table"])


class _Boom(Exception):
    pass


def _failing_iterable(batches, at):
    for i, b in enumerate(batches):
        if i == at:
            raise _Boom(f"iterable broke at {i}")
        yield b


def _assert_no_prefetch_threads(timeout=2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [t for t in threading.enumerate() if t.name.startswith("stpipe-prefetch")]:
            return
        time.sleep(0.01)
    raise AssertionError([t.name for t in threading.enumerate()])


@DEPTHS
def test_exception_in_iterable(depth):
    batches = make_batches("zipf")
    ref, _ = train(0, "adam", batches[:7])
    emb = make_emb()
    opt = OPTIMIZERS["adam"](emb.parameters())
    done = []
    with Pipeline(emb, optimizer=opt, ids="ids", depth=depth) as pipe:
        with pytest.raises(_Boom, match="iterable broke at 7") as info:
            for step in pipe.run(_failing_iterable(batches, 7)):
                with step:
                    loss_fn(emb(step.ids), step.batch["target"]).backward()
                    opt.step()
                    opt.zero_grad()
                done.append(step.index)
    assert done == list(range(7))
    if depth:
        assert any("reading batch 7 from the iterable" in n for n in info.value.__notes__)
        assert any("stpipe-prefetch" in n for n in info.value.__notes__)
    assert_same(ref, snapshot(emb, opt))
    _assert_no_prefetch_threads()


@pytest.mark.parametrize("depth", [1, 2], ids=lambda d: f"depth{d}")
def test_exception_in_prefetch_thread_injected(depth, monkeypatch):
    batches = make_batches("hot")
    ref, _ = train(0, "adam", batches[:7])
    emb = make_emb()
    opt = OPTIMIZERS["adam"](emb.parameters())
    calls = {"n": 0}
    real_gather = emb.table.gather

    def flaky_gather(*a, **kw):
        if threading.current_thread().name.startswith("stpipe-prefetch"):
            calls["n"] += 1
            if calls["n"] == 8:  # batch 7's row gather
                raise RuntimeError("injected gather failure")
        return real_gather(*a, **kw)

    monkeypatch.setattr(emb.table, "gather", flaky_gather)
    with Pipeline(emb, optimizer=opt, ids="ids", depth=depth) as pipe:
        with pytest.raises(RuntimeError, match="injected gather failure") as info:
            for step in pipe.run(batches):
                with step:
                    loss_fn(emb(step.ids), step.batch["target"]).backward()
                    opt.step()
                    opt.zero_grad()
    assert any("gathering batch 7" in n for n in info.value.__notes__)
    assert_same(ref, snapshot(emb, opt))
    _assert_no_prefetch_threads()
    # the pipeline object can run again after the failure
    monkeypatch.setattr(emb.table, "gather", real_gather)


@DEPTHS
def test_bad_ids_raise_before_any_copy(depth):
    batches = make_batches("hot", steps=6)
    batches[4] = {"ids": torch.tensor([1, 2, NUM_ROWS + 5]), "target": torch.zeros(3)}
    ref, _ = train(0, "sgd_momentum", batches[:4])
    emb = make_emb()
    opt = OPTIMIZERS["sgd_momentum"](emb.parameters())
    with Pipeline(emb, optimizer=opt, ids="ids", depth=depth) as pipe:
        with pytest.raises(StpipeIndexError, match=f"row id {NUM_ROWS + 5} at position 2"):
            for step in pipe.run(batches):
                with step:
                    loss_fn(emb(step.ids), step.batch["target"]).backward()
                    opt.step()
                    opt.zero_grad()
    assert_same(ref, snapshot(emb, opt))


@pytest.mark.parametrize("depth", [1, 2], ids=lambda d: f"depth{d}")
def test_exception_in_ids_function(depth):
    emb = make_emb()

    def ids(b):
        if b == 2:
            raise LookupError("no ids here")
        return [b]

    with Pipeline(emb, ids=ids, depth=depth) as pipe:
        got = []
        with pytest.raises(LookupError) as info:
            for step in pipe.run(range(5)):
                with step:
                    got.append(step.index)
    assert got == [0, 1]
    assert any("computing the ids of batch 2" in n for n in info.value.__notes__)


@DEPTHS
def test_break_and_close_never_hang(depth):
    emb = make_emb()
    opt = torch.optim.Adam(emb.parameters(), lr=0.1)

    def endless():
        i = 0
        while True:
            yield torch.tensor([i % 50, (i + 1) % 50])
            i += 1

    t0 = time.monotonic()
    with Pipeline(emb, optimizer=opt, depth=depth) as pipe:
        for step in pipe.run(endless()):
            with step:
                emb(step.ids).sum().backward()
                opt.step()
            if step.index == 10:
                break
    assert time.monotonic() - t0 < 10
    _assert_no_prefetch_threads()
    # after close, the pipeline refuses new runs
    with pytest.raises(StpipeRuntimeError, match="closed"):
        pipe.run([1])


def test_close_with_a_hanging_iterable_returns():
    release = threading.Event()

    def hanging():
        yield torch.tensor([1, 2])
        release.wait(30)
        yield torch.tensor([3])

    emb = make_emb()
    pipe = Pipeline(emb, depth=1, join_timeout=0.2)
    it = pipe.run(hanging())
    step = next(it)
    with step:
        pass
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match="did not stop"):
        pipe.close()
    assert time.monotonic() - t0 < 5
    release.set()
    _assert_no_prefetch_threads()


def test_step_skipped_when_not_entered_and_guards():
    emb = make_emb()
    before = emb.table.tensor().clone()
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    with Pipeline(emb, optimizer=opt, depth=1) as pipe:
        steps = pipe.run([torch.tensor([1, 2])] * 4)
        for step in steps:
            if step.index % 2:
                continue  # never entered: skipped, nothing written
            with step:
                emb(step.ids).sum().backward()
                opt.step()
                opt.zero_grad()
            with pytest.raises(StpipeRuntimeError, match="already entered"):
                with step:
                    pass
            with pytest.raises(StpipeRuntimeError, match="another run"):
                next(pipe.run([1]))
    assert pipe.stats["skipped"] == 2 and pipe.stats["steps"] == 2
    # two SGD steps of lr 0.1 on rows 1, 2 (gradient 1 per element)
    after = emb.table.tensor()
    assert torch.allclose(after[1:3], before[1:3] - 0.2)
    assert torch.equal(after[3:], before[3:])


def test_runs_again_and_empty_iterable():
    emb = make_emb()
    opt = torch.optim.Adam(emb.parameters(), lr=0.1)
    pipe = Pipeline(emb, optimizer=opt)
    assert list(pipe.run([])) == []
    for _ in range(2):
        for step in pipe.run([torch.tensor([1, 2]), torch.tensor([2, 3])]):
            with step:
                emb(step.ids).sum().backward()
                opt.step()
                opt.zero_grad()
    assert int(opt.state[emb.weight]["step"]) == 4
    pipe.close()
    pipe.close()  # idempotent


def test_run_refuses_a_non_iterable_and_stays_usable():
    """``run(None)`` (or any non-iterable) is a TypeError that names what was given; the
    pipeline starts no run and trains normally afterwards."""
    emb = make_emb()
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    with Pipeline(emb, optimizer=opt, depth=1) as pipe:
        for bad in (None, 3):
            with pytest.raises(TypeError, match=f"iterable of batches.*got {type(bad).__name__}") as info:
                pipe.run(bad)
            assert isinstance(info.value, StpipeTypeError)
        before = emb.table.tensor().clone()
        for step in pipe.run([torch.tensor([1, 2])]):
            with step:
                emb(step.ids).sum().backward()
                opt.step()
                opt.zero_grad()
    after = emb.table.tensor()
    assert torch.allclose(after[1:3], before[1:3] - 0.1)
    assert torch.equal(after[3:], before[3:])


def test_unsplittable_state_is_a_clear_error():
    emb = make_emb()
    before = emb.table.tensor().clone()
    opt = torch.optim.Adafactor(emb.parameters(), lr=0.01)
    with Pipeline(emb, optimizer=opt, depth=1) as pipe:
        with pytest.raises(StpipeValueError, match="'row_var'|'col_var'"):
            for step in pipe.run([torch.tensor([1, 2, 3])] * 3):
                with step:
                    emb(step.ids).sum().backward()
                    opt.step()
    assert torch.equal(emb.table.tensor(), before)
    assert emb.weight not in opt.state


def test_step_repr_and_attributes():
    emb = make_emb()
    with Pipeline(emb, ids="ids", depth=0) as pipe:
        for step in pipe.run([{"ids": torch.tensor([[3, 1], [3, 2]])}]):
            assert isinstance(step, Step)
            assert "ready" in repr(step)
            with step:
                assert step.plans[None].unique.tolist() == [1, 2, 3]
                assert emb.weight.shape == (3, DIM)
                assert emb(step.batch["ids"]).shape == (2, 2, DIM)


def test_slot_moves_are_cached_per_stack_and_table_set(monkeypatch):
    """_Slots.move prepares a fused move once per (op, first plane, planes) for the slot's
    current stack and table objects; a new stack (ensure) or other tables prepare again."""
    made = []

    def fake_prepare(op, tables, planes):
        made.append((op, [id(t) for t in tables], planes.data_ptr(), tuple(planes.shape)))
        return ("move", len(made))

    monkeypatch.setattr(pipeline_mod, "_prepare_move", fake_prepare)
    emb = make_emb()
    slots = pipeline_mod._Slots(emb, 2)
    slots.ensure(0, 5, (), (None,))
    slots.ensure(1, 5, (), (None,))
    a = slots.move(0, "gather", 0, [emb.table])
    assert a == ("move", 1) and slots.move(0, "gather", 0, [emb.table]) is a
    assert made[0][2] == slots.stack[0].data_ptr() and made[0][3][0] == 1
    assert slots.move(0, "scatter", 0, [emb.table]) == ("move", 2)  # per op
    assert slots.move(1, "gather", 0, [emb.table]) == ("move", 3)  # per slot
    assert made[2][2] == slots.stack[1].data_ptr()
    other = make_emb(seed=2)
    assert slots.move(0, "gather", 0, [other.table]) == ("move", 4)  # other table object
    assert slots.move(0, "gather", 0, [emb.table]) == ("move", 5)  # replaced the entry
    old = slots.stack[0]
    slots.ensure(0, 10 * old.shape[1], (), (None,))  # grows: a new stack
    assert slots.stack[0] is not old and not slots.moves[0]
    assert slots.move(0, "gather", 0, [emb.table]) == ("move", 6)
    assert made[-1][2] == slots.stack[0].data_ptr()
    other.table.close()


# ------------------------------------------------------------------- prefetch gate
def _gate_events(depth, monkeypatch, gate_on=True, lookups=True):
    """Train with a pause before each step's lookup; return the order of events: the
    test's ('lookup', i) just before step i's first lookup and the prefetch thread's
    ('issue', j) when it begins issuing batch j."""
    monkeypatch.setenv("STPIPE_PREFETCH_GATE", "1" if gate_on else "0")
    events = []
    orig = Pipeline._issue

    def issue(self, flight, run):
        events.append(("issue", flight.index))
        return orig(self, flight, run)

    monkeypatch.setattr(Pipeline, "_issue", issue)
    emb = make_emb()
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    batches = make_batches("zipf", steps=8)
    with Pipeline(emb, optimizer=opt, ids=lambda b: b["ids"], depth=depth) as pipe:
        for step in pipe.run(batches):
            with step:
                time.sleep(0.02)  # the prefetch thread would issue now without the gate
                if lookups:
                    events.append(("lookup", step.index))
                    loss = loss_fn(emb(step.ids), step.batch["target"])
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
    return events, pipe


def _issued_before_lookup(events, depth):
    """Batches j issued before step j - depth began (its lookup event)."""
    pos = {e: i for i, e in enumerate(events)}
    return [j for kind, j in events if kind == "issue" and j - depth >= 0
            and pos[("issue", j)] < pos[("lookup", j - depth)]]


@pytest.mark.parametrize("depth", [1, 2])
def test_prefetch_gate_issues_after_the_step_begins(depth, monkeypatch):
    events, pipe = _gate_events(depth, monkeypatch)
    assert pipe.stats["steps"] == 8
    assert [j for kind, j in events if kind == "issue"] == list(range(8))
    assert _issued_before_lookup(events, depth) == []


def test_prefetch_gate_off_issues_during_the_step_entry(monkeypatch):
    # the control: without the gate the prefetch thread issues during the pause
    events, _ = _gate_events(1, monkeypatch, gate_on=False)
    assert _issued_before_lookup(events, 1) != []


@pytest.mark.parametrize("depth", [1, 2])
def test_prefetch_gate_opens_without_lookups(depth, monkeypatch):
    # steps that never call the embedding, and steps never entered, do not stall the run
    events, pipe = _gate_events(depth, monkeypatch, lookups=False)
    assert pipe.stats["steps"] == 8
    emb = make_emb()
    with Pipeline(emb, ids=lambda b: b["ids"], depth=depth) as pipe:
        for step in pipe.run(make_batches("zipf", steps=8)):
            if step.index % 2:
                continue
            with step:
                pass
    assert pipe.stats["skipped"] == 4 and pipe.stats["steps"] == 4


def test_prefetch_gate_is_off_by_default(monkeypatch):
    monkeypatch.delenv("STPIPE_PREFETCH_GATE", raising=False)
    emb = make_emb()
    with Pipeline(emb, ids=lambda b: b["ids"], depth=1) as pipe:
        for step in pipe.run(make_batches("zipf", steps=2)):
            assert pipe._run.gate is None
            with step:
                pass
    monkeypatch.setenv("STPIPE_PREFETCH_GATE", "1")
    with Pipeline(emb, ids=lambda b: b["ids"], depth=1) as pipe:
        for step in pipe.run(make_batches("zipf", steps=2)):
            assert pipe._run.gate is not None
            with step:
                pass


# ------------------------------------------------ what the user's step may do to the state
def _adam_run(depth, steps, during):
    """Adam over Zipf batches; ``during(step, opt, emb)`` runs in each step after
    ``opt.step()``. Returns the embedding and the batches."""
    emb = make_emb()
    opt = torch.optim.Adam(emb.parameters(), lr=0.01)
    batches = make_batches("zipf", steps=steps)
    with Pipeline(emb, optimizer=opt, ids="ids", depth=depth) as pipe:
        for step in pipe.run(batches):
            with step:
                loss_fn(emb(step.ids), step.batch["target"]).backward()
                opt.step()
                opt.zero_grad()
                during(step, opt, emb)
        pipe.synchronize()
    return emb, batches


@pytest.mark.parametrize("depth", [0, 1])
def test_state_replaced_during_step_is_written_back(depth):
    """The optimizer's per-row state replaced by another tensor during a step (not the
    installed view): the write-back takes the replacement's values."""
    seen = {}

    def replace(step, opt, emb):
        if step.index == 2:
            st = opt.state[emb.weight]
            st["exp_avg"] = torch.full_like(st["exp_avg"], 0.25)
            seen["uniq"] = step.plans[None].unique

    emb, batches = _adam_run(depth, 4, replace)
    uniq = seen["uniq"]
    got = emb.state_tables["exp_avg"].tensor()[torch.from_numpy(uniq)]
    # step 3 updated some of these rows again; those it did not touch hold 0.25
    later = set(batches[3]["ids"].tolist())
    keep = [i for i, r in enumerate(uniq.tolist()) if r not in later]
    assert keep and torch.equal(got[keep], torch.full((len(keep), DIM), 0.25))


@pytest.mark.parametrize("depth", [0, 1])
def test_state_key_dropped_during_step_is_an_error(depth):
    def drop(step, opt, emb):
        if step.index == 1:
            del opt.state[emb.weight]["exp_avg_sq"]

    with pytest.raises(StpipeRuntimeError, match="exp_avg_sq"):
        _adam_run(depth, 3, drop)


@DEPTHS
@pytest.mark.parametrize("how", ["drop-state-key", "replace-weight"])
def test_write_back_refusal_fails_the_step_and_goes_on(depth, how):
    """The write-back's own checks refusing a step (a state key dropped, ``emb.weight``
    replaced by another shape), caught by the user at two steps in a row: each such step
    fails like a step whose code raised (nothing written, scalar state restored, the slot
    given back), and training goes on to the end, equal to a run without those batches."""
    fail = (3, 4)
    batches = make_batches("hot")
    ref, _ = train(0, "adam", batches, skip=fail)
    emb = make_emb()
    opt = OPTIMIZERS["adam"](emb.parameters())
    with Pipeline(emb, optimizer=opt, ids=lambda b: b["ids"], depth=depth) as pipe:
        for step in pipe.run(batches):
            try:
                with step:
                    loss_fn(emb(step.ids), step.batch["target"]).backward()
                    opt.step()
                    opt.zero_grad()
                    if step.index in fail:
                        if how == "drop-state-key":
                            del opt.state[emb.weight]["exp_avg_sq"]
                        else:
                            emb.weight.data = torch.zeros(1, DIM)
            except StpipeRuntimeError as exc:
                assert step.index in fail and ("exp_avg_sq" in str(exc) or "replaced" in str(exc))
    assert pipe.stats["failed"] == len(fail) and pipe.stats["steps"] == STEPS - len(fail)
    assert_same(ref, snapshot(emb, opt))
    _assert_no_prefetch_threads()


@DEPTHS
def test_step_skipped_by_the_loop_cannot_be_entered(depth):
    """A step the loop moved past before entering it (``next()`` twice, a look-ahead
    wrapper), or one of a run that ended, is refused on entry; no row changes (lr 0)."""
    emb = HostEmbedding(10, 2, device="cpu", init="zeros")
    emb.table.tensor().copy_(torch.arange(10.0).unsqueeze(1).repeat(1, 2))
    want = emb.table.tensor().clone()
    opt = torch.optim.SGD(emb.parameters(), lr=0.0)

    def train_step(s):
        with s:
            emb(s.ids).sum().backward()
            opt.step()

    with Pipeline(emb, optimizer=opt, depth=depth) as pipe:
        it = pipe.run([torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([5, 6])])
        s0, s1 = next(it), next(it)
        with pytest.raises(StpipeRuntimeError, match="step 0 was skipped"):
            s0.__enter__()
        train_step(s1)
        for s in it:
            train_step(s)
        assert pipe.stats["skipped"] == 1 and pipe.stats["steps"] == 2
        it = pipe.run([torch.tensor([1, 2])])
        old = next(it)
        it.close()
        it = pipe.run([torch.tensor([3, 4]), torch.tensor([5, 6])])
        s = next(it)
        with pytest.raises(StpipeRuntimeError, match="step 0 was skipped"):
            old.__enter__()
        train_step(s)
        for s in it:
            train_step(s)
    assert torch.equal(emb.table.tensor(), want)
    _assert_no_prefetch_threads()


def test_concat_ids_matches_numpy():
    """The prefetch thread's concatenation of multi-part ids (GIL released for long int64
    parts) gives np.concatenate's flat int64 result for any dtype and layout."""
    from stpipe.pipeline import _PACK_MIN, _concat_ids

    rng = np.random.default_rng(0)
    a = rng.integers(0, 1 << 40, (_PACK_MIN, 3))
    b = rng.integers(0, 1 << 40, 17)
    c = rng.integers(0, 100, (50, 4)).astype(np.int32)
    d = rng.integers(0, 1 << 40, (3 * _PACK_MIN, 2))[:, 0]  # not contiguous
    for parts in ([a, b], [a, c], [d, a], [b], [c, c], [a[:0], b]):
        got = _concat_ids(parts)
        want = np.concatenate([p.reshape(-1).astype(np.int64) for p in parts])
        assert got.dtype == np.int64 and got.shape == want.shape
        assert np.array_equal(got, want)


def test_ring_region_guard_recorded_later():
    """A ring region whose event comes later (the pipeline's lean upload): reusing it
    before the event is set synchronises the stream; after, waits on the event."""
    from stpipe._staging import _wait_region

    calls = []

    class Fake:
        def __init__(self, name):
            self.name = name

        def synchronize(self):
            calls.append(self.name)

    _wait_region([0, 10, None, Fake("stream")])
    _wait_region([0, 10, Fake("event"), Fake("stream")])
    _wait_region((0, 10, Fake("event2")))
    assert calls == ["stream", "event", "event2"]


def test_ring_alloc_waits_for_guards_recorded_later():
    """The ring's FIFO regions with a guard to come (no pinned memory needed: the ring's
    bookkeeping only): reuse waits on the event once set, on the stream before."""
    from stpipe._staging import _Ring

    log = []

    class Ev:
        def __init__(self, name, done=False):
            self.name, self.done = name, done

        def synchronize(self):
            log.append(self.name)

        def query(self):
            return self.done

    ring = object.__new__(_Ring)
    ring.size, ring.head = 1000, 0
    from collections import deque
    ring.pending = deque()
    a = ring.alloc(400)
    ea = ring.guard_later(a, a + 400, Ev("stream-a"))
    ea[2] = Ev("event-a")
    b = ring.alloc(400)
    ring.guard_later(b, b + 400, Ev("stream-b"))  # its event never set (a failed issue)
    assert (a, b) == (0, 400) and log == []
    c = ring.alloc(400)  # wraps: reuses a's and b's bytes
    assert c == 0 and log == ["event-a"]
    d = ring.alloc(400)
    assert d == 400 and log == ["event-a", "stream-b"]
    ring.pending.append((0, 10, Ev("done", done=True)))
    ring.alloc(10)  # completed regions at the head are dropped without waiting
    assert log == ["event-a", "stream-b"]


def test_view_templates_are_cached_and_bounded(monkeypatch):
    """The lean upload's view templates: one meta tensor per shape, reused, and the cache
    cleared when full (batches of ever new shapes do not grow it without bound)."""
    import stpipe._staging as P

    monkeypatch.setattr(P, "_TEMPLATES", {})
    monkeypatch.setattr(P, "_TEMPLATES_MAX", 3)
    a = P._template((2, 3))
    assert a.device.type == "meta" and tuple(a.shape) == (2, 3) and P._template((2, 3)) is a
    P._template((4,))
    P._template(())
    assert len(P._TEMPLATES) == 3
    b = P._template((5, 1))
    assert tuple(b.shape) == (5, 1) and len(P._TEMPLATES) == 1
    flat = torch.arange(20)
    views = P._UNFLATTEN(flat, [P._template((2, 3)), P._template((4,)), P._template(())])
    assert [tuple(v.shape) for v in views] == [(2, 3), (4,), ()]
    assert views[1].tolist() == [6, 7, 8, 9] and int(views[2]) == 10


# ------------------------------------------------- index tensors held for the step
@pytest.mark.parametrize("depth", [0, 1])
def test_lookup_index_tensors_are_held_for_the_step(depth):
    """Each part's inverse (what ``torch.embedding`` saves for backward) has a DLPack
    capsule that aliases it during the step (same memory, shape and values); the
    capsules are dropped when the step ends."""
    emb = HostEmbedding(NUM_ROWS, DIM)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    rng = np.random.default_rng(0)
    batches = [{"a": rng.integers(0, NUM_ROWS, size=(4, 5)), "b": rng.integers(0, NUM_ROWS, size=7)}
               for _ in range(3)]
    seen = 0
    with Pipeline(emb, opt, depth=depth, ids=lambda b: (b["a"], b["b"])) as pipe:
        for step in pipe.run(batches):
            with step:
                a, b = step.ids
                loss = emb(a).sum() + emb(b).sum()
                loss.backward()
                opt.step()
                opt.zero_grad()
                tf = step._flight.tables[None]
                assert len(tf.holds) == len(tf.part_inverse) == 2
                for hold, inv in zip(tf.holds, tf.part_inverse):
                    back = torch.utils.dlpack.from_dlpack(hold)
                    assert back.data_ptr() == inv.data_ptr()
                    assert back.shape == inv.shape and torch.equal(back, inv)
                    seen += 1
            assert tf.holds == []  # dropped when the step ends
    assert seen == 6


def _refs_after_backward(hold: bool) -> int:
    """``sys.getrefcount`` of the step's index tensor right after ``backward()``."""
    import sys

    emb = HostEmbedding(NUM_ROWS, DIM)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    pipe = Pipeline(emb, opt, depth=0)
    pipe._hold_indices = hold
    n = None
    with pipe:
        for step in pipe.run([np.arange(10, 30)]):
            with step:
                emb(step.ids).sum().backward()
                inv = step._flight.tables[None].part_inverse[0]
                n = sys.getrefcount(inv)
                opt.step()
                opt.zero_grad()
    return n


def test_held_index_tensor_keeps_its_cpp_reference_through_backward():
    """In PyTorch's PyObject preservation a C++ reference beyond the first increfs the
    tensor's PyObject; without the hold, backward releases the lookup's saved index (the
    release that takes the GIL on autograd's thread), with it a C++ reference remains."""
    import sys

    from torch.utils.dlpack import to_dlpack

    t = torch.zeros(3, dtype=torch.int64)
    before = sys.getrefcount(t)
    cap = to_dlpack(t)
    if sys.getrefcount(t) != before + 1:
        pytest.skip(f"this PyTorch ({torch.__version__}) does not incref a tensor's PyObject for C++ references")
    del cap
    assert _refs_after_backward(True) == _refs_after_backward(False) + 1


@pytest.mark.parametrize("depth", [0, 1])
def test_lookup_outputs_are_held_until_the_step_ends(depth):
    """Each differentiable lookup output is held by a view of it during the step (so the
    release of a loss's views of it in backward takes no GIL); lookups without grad are
    not held; the views are dropped when the step ends."""
    emb = HostEmbedding(NUM_ROWS, DIM)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, NUM_ROWS, size=(3, 4)) for _ in range(3)]
    with Pipeline(emb, opt, depth=depth) as pipe:
        for step in pipe.run(batches):
            with step:
                u = emb(step.ids)
                v = emb(step.ids)
                with torch.no_grad():
                    emb(step.ids)  # not differentiable: not held
                held = emb._binding.outputs
                assert len(held) == 2
                assert all(h._base is o for h, o in zip(held, (u, v)))
                (u * v).sum().backward()
                opt.step()
                opt.zero_grad()
            assert step._flight.tables[None].binding.outputs == []


def test_lookup_outputs_held_are_bounded_per_step(monkeypatch):
    """Past ``_HOLD_OUTPUT_BYTES`` of one table's outputs in a step (e.g. gradient
    accumulation over many micro-batches) lookups are not held; training is unchanged."""
    monkeypatch.setattr(pipeline_mod, "_HOLD_OUTPUT_BYTES", 3 * (3 * 4 * DIM * 4))  # three (3, 4) lookups
    emb = HostEmbedding(NUM_ROWS, DIM)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    ids = np.arange(12).reshape(3, 4)
    with Pipeline(emb, opt, depth=0) as pipe:
        for step in pipe.run([ids]):
            with step:
                for _ in range(5):  # five micro-batches, one backward each
                    emb(step.ids).sum().backward()
                assert len(emb._binding.outputs) == 3
                assert emb._binding.outputs_room == 0
                opt.step()
                opt.zero_grad()


@pytest.mark.parametrize("depth", [1, 2])
def test_prefetch_thread_reads_a_bounded_distance_ahead(depth):
    # slow steps let the thread run as far ahead as it can: the batch being trained, the
    # depth batches in flight and one planned batch waiting for a slot, no more
    pulled = []

    def source():
        for b in make_batches("zipf", steps=12):
            pulled.append(b)
            yield b

    emb = HostEmbedding(NUM_ROWS, DIM, device="cpu")
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    ahead = []
    with Pipeline(emb, optimizer=opt, depth=depth, ids=lambda b: b["ids"]) as pipe:
        for step in pipe.run(source()):
            with step:
                emb(step.ids).sum().backward()
                opt.step()
                time.sleep(0.02)
                ahead.append(len(pulled) - (step.index + 1))
    assert max(ahead) <= depth + 1, ahead
    assert max(ahead) >= depth, ahead  # it did run ahead


@pytest.mark.parametrize("depth", [0, 1])
def test_int32_inverses_change_no_result(depth):
    """The lookups' index tensors are int32 (``Pipeline._inv32``, the default) or int64:
    the same tables and state bit for bit, on every pattern's ids."""
    got = {}
    for inv32 in (False, True):
        emb = make_emb()
        opt = OPTIMIZERS["adam"](emb.parameters())
        seen = set()
        with Pipeline(emb, optimizer=opt, ids=lambda b: b["ids"], depth=depth) as pipe:
            pipe._inv32 = inv32
            data = [b for pattern in PATTERNS for b in make_batches(pattern, steps=4)]
            for step in pipe.run(data):
                with step:
                    seen.update(part.inverse.dtype for part in emb._binding.parts)
                    loss_fn(emb(step.ids), step.batch["target"]).backward()
                    opt.step()
                    opt.zero_grad()
        assert seen == {torch.int32 if inv32 else torch.int64}
        got[inv32] = snapshot(emb, opt)
    assert_same(got[False], got[True])


@pytest.mark.parametrize("pair_on", [True, False])
def test_paired_launches_keep_order_and_arguments(pair_on):
    """The pipeline's launcher of per-table prepared launches (CUDA-only in real runs; here
    with stand-ins): two neighbours become one paired call with both argument lists and the
    shared tail, in table order; a pair the maker refuses, an odd last one, or pairing off
    launches each alone with its own arguments; a pair is made once per pair of objects."""
    emb = HostEmbedding(10, 2)
    pipe = Pipeline(emb, ids=lambda b: b)
    pipe._pair = pair_on
    calls, made = [], []

    def single(name):
        return lambda *a: calls.append((name, a))

    a, b, c, d, e = (single(x) for x in "abcde")

    def make(x, y):
        made.append((x, y))
        return None if x is c else (lambda *args: calls.append(("pair", args)))

    items = [(a, (1, 10)), (b, (2, 20)), (c, (3, 30)), (d, (4, 40)), (e, (5, 50))]
    tail = ("stream", "pending")
    pipe._launch_paired(items, make, tail)
    if pair_on:
        # a+b pair; c+d refused -> c alone; d+e pair
        assert calls == [("pair", (1, 10, 2, 20) + tail), ("c", (3, 30) + tail), ("pair", (4, 40, 5, 50) + tail)]
        assert made == [(a, b), (c, d), (d, e)]
        calls.clear()
        pipe._launch_paired(items, make, tail)  # the pairs (and the refusal) are cached
        assert len(made) == 3 and len(calls) == 3
    else:
        assert calls == [(n, args + tail) for n, args in zip("abcde", (i[1] for i in items))]
        assert made == []
    pipe.close()


@DEPTHS
@pytest.mark.parametrize("opt_name", ["SGD", "Adam"])
def test_optimizer_step_after_the_exit_changes_nothing(depth, opt_name):
    """An ``opt.step()`` after ``with step:`` (a gradient-accumulation loop stepping
    outside the step) is dropped, as the README says, at every depth: outside a step the
    working parameter is ``(0, dim)`` without a gradient (regression: it still viewed the
    freed slot, which at depth >= 1 the prefetch thread refills with a later batch's
    rows, and the late step updated those)."""
    batches = [torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([5, 6]), torch.tensor([7, 8])]
    emb = HostEmbedding(10, 4, device="cpu", generator=torch.Generator().manual_seed(0))
    before = emb.table.tensor().clone()
    make = {"SGD": lambda p: torch.optim.SGD(p, lr=1.0), "Adam": lambda p: torch.optim.Adam(p, lr=0.5)}
    opt = make[opt_name](emb.parameters())
    with Pipeline(emb, optimizer=opt, depth=depth) as pipe:
        for step in pipe.run(batches):
            if step.index == 0:  # a gradient and no optimizer step: said once
                with pytest.warns(RuntimeWarning, match="no optimizer step: it is dropped"):
                    with step:
                        emb(step.ids).sum().backward()
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    with step:
                        emb(step.ids).sum().backward()
            assert tuple(emb.weight.shape) == (0, 4) and emb.weight.grad is None
            time.sleep(0.05)  # at depth >= 1 the prefetch thread refills the freed slot
            opt.step()
            opt.zero_grad()
    assert torch.equal(emb.table.tensor(), before)


@DEPTHS
def test_ids_dict_with_none_reads_the_tables_name(depth):
    """``ids={name: None}`` reads ``batch[name]``, as documented (regression: it read
    ``batch[None]``, a KeyError in the prefetch thread)."""
    a, b = make_emb(1), make_emb(2)
    batches = [{"a": torch.tensor([1, 2]), "y": torch.tensor([3])}]
    seen = []
    with Pipeline({"a": a, "b": b}, ids={"a": None, "b": "y"}, depth=depth) as pipe:
        for step in pipe.run(batches):
            with step:
                seen.append((step.index, {k: v.tolist() for k, v in step.ids.items()}))
    assert seen == [(0, {"a": [1, 2], "b": [3]})]


def test_run_checks_for_an_active_run_at_the_call_and_keeps_its_own_to_device():
    """``run()`` during an active run raises at the call (regression: at the generator's
    first ``next()``, after it had switched the active run's ``to_device``); each run
    keeps the ``to_device`` it was called with."""
    pipe = Pipeline(make_emb(), depth=1)
    with pipe:
        g1 = pipe.run([torch.tensor([1])] * 3, to_device=True)
        first = next(g1)
        with first:
            pass
        with pytest.raises(StpipeRuntimeError, match="another run"):
            pipe.run([torch.tensor([2])], to_device=False)
        assert pipe._to_device is True
        for step in g1:
            with step:
                pass
        g3 = pipe.run([torch.tensor([1])], to_device=False)
        g4 = pipe.run([torch.tensor([1])], to_device=True)  # neither started yet
        for step in g3:
            assert pipe._to_device is False
            with step:
                pass
        for step in g4:
            assert pipe._to_device is True
            with step:
                pass


def test_constructor_refuses_ids_and_join_timeout_of_the_wrong_kind():
    """A dict or list ``ids=`` for one table, and a non-number ``join_timeout``, are
    refused when the pipeline is built (regression: a TypeError in the prefetch thread,
    a bare ValueError from float())."""
    with pytest.raises(StpipeTypeError, match="for one table"):
        Pipeline(make_emb(), ids={"x": "ids"})
    with pytest.raises(StpipeTypeError, match="for several tables"):
        Pipeline({"a": make_emb(1), "b": make_emb(2)}, ids="key")
    with pytest.raises(StpipeTypeError, match="join_timeout"):
        Pipeline(make_emb(), join_timeout="5s")
    with pytest.raises(StpipeValueError, match="join_timeout"):
        Pipeline(make_emb(), join_timeout=-1)

"""Checkpoint tests (CPU): resume is bit-identical, bad files are refused, saves are atomic.

Resume: train ``k`` steps, break out of the loop with batches still in flight, save, build
fresh embeddings/optimizer/pipeline, load, train on the remaining batches; the tables, the
per-row state tables and the scalar state equal an uninterrupted run bit for bit. Bad
checkpoints (a flipped byte, a truncated file, other shapes/dtypes/optimizer, a pickled
``.npy``) are refused with StpipeValueError before anything is written. Crash safety: a
child process saving over a good checkpoint is SIGKILLed at every step of the save protocol
and at random moments; what is left loads and equals one of the two versions exactly.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from collections import namedtuple
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import stpipe.checkpoint as ckpt
from stpipe import StpipeRuntimeError, StpipeTypeError, StpipeValueError
from stpipe.embedding import HostEmbedding
from stpipe.pipeline import Pipeline

NUM_ROWS = 1000
DIM = 8
STEPS = 12
BATCH = 24

OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1, lr_decay=0.01),
}
COEF = torch.linspace(-1.0, 1.0, DIM)


def make_batches(steps=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(steps):
        # overlapping windows plus a hot row: consecutive batches share rows (the hazard)
        ids = np.concatenate([[7], (rng.zipf(1.3, BATCH - 1) - 1) % 60, np.arange(3 * i, 3 * i + 4)])
        out.append({"ids": torch.from_numpy(ids.astype(np.int64)),
                    "target": torch.from_numpy(rng.standard_normal(ids.shape[0]))})
    return out


def loss_fn(rows, target):
    pred = (torch.tanh(rows) * COEF.to(rows.device, rows.dtype)).sum(-1)
    return ((pred - target.to(rows.device, rows.dtype)) ** 2).sum()


def make(opt_name, depth, seed=1, device="cpu"):
    emb = HostEmbedding(NUM_ROWS, DIM, generator=torch.Generator().manual_seed(seed), device=device)
    opt = OPTIMIZERS[opt_name](emb.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    pipe = Pipeline(emb, optimizer=opt, ids="ids", depth=depth)
    return emb, opt, sched, pipe


def train_steps(pipe, emb, opt, sched, batches, stop_after=None):
    """Train; with ``stop_after`` break out after that many steps and return the live iterator."""
    it = pipe.run(batches)
    for i, step in enumerate(it):
        with step:
            loss_fn(emb(step.ids), step.batch["target"]).backward()
            opt.step()
            opt.zero_grad()
        sched.step()
        if stop_after is not None and i + 1 == stop_after:
            return it
    return None


def snapshot(emb, opt):
    out = {"table": emb.table.tensor().clone()}
    for key, t in emb.state_tables.items():
        out["state:" + key] = t.tensor().clone()
    for key, v in opt.state.get(emb.weight, {}).items():
        if key not in emb.state_tables:
            out["scalar:" + key] = v.detach().cpu().clone() if torch.is_tensor(v) else v
    out["lr"] = opt.param_groups[0]["lr"]
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if torch.is_tensor(a[k]):
            assert a[k].dtype == b[k].dtype, k
            assert torch.equal(a[k], b[k]), f"{k}: max diff {(a[k].double() - b[k].double()).abs().max()}"
        else:
            assert a[k] == b[k], k


def _wait_in_flight(pipe, timeout=5.0):
    end = time.monotonic() + timeout
    while not pipe._inflight and time.monotonic() < end:
        time.sleep(0.005)
    return bool(pipe._inflight)


def reference(opt_name, batches):
    emb, opt, sched, pipe = make(opt_name, 0)
    with pipe:
        train_steps(pipe, emb, opt, sched, batches)
    return snapshot(emb, opt)


# ------------------------------------------------------------------------- resume
@pytest.mark.parametrize("depth", [0, 1], ids=lambda d: f"depth{d}")
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("k", [1, 5])
def test_resume_is_bit_identical(tmp_path, opt_name, depth, k):
    batches = make_batches()
    want = reference(opt_name, batches)

    emb, opt, sched, pipe = make(opt_name, depth)
    it = train_steps(pipe, emb, opt, sched, batches, stop_after=k)
    if depth:
        assert _wait_in_flight(pipe), "expected a batch gathered ahead when saving"
    path = pipe.save_checkpoint(tmp_path / "ck", extra={"step": k, "sched": sched.state_dict()})
    it.close()
    pipe.close()
    del emb, opt, pipe

    emb2, opt2, sched2, pipe2 = make(opt_name, depth, seed=99)  # other init: everything is loaded
    extra = pipe2.load_checkpoint(path)
    assert extra["step"] == k
    sched2.load_state_dict(extra["sched"])
    with pipe2:
        train_steps(pipe2, emb2, opt2, sched2, batches[k:])
    assert_same(snapshot(emb2, opt2), want)
    assert pipe2.stats["steps"] == len(batches)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("k", [0, 4])
def test_rewind_a_trained_pipeline(tmp_path, opt_name, k):
    """Loading an earlier checkpoint (step 0 included: Adagrad's state then still has the
    shape of the empty parameter) into the pipeline that trained on, then training again,
    gives what training straight through gives."""
    batches = make_batches()
    want = reference(opt_name, batches)
    emb, opt, sched, pipe = make(opt_name, 1)
    with pipe:
        train_steps(pipe, emb, opt, sched, batches[:k])
        path = pipe.save_checkpoint(tmp_path / "ck", extra=sched.state_dict())
        train_steps(pipe, emb, opt, sched, batches[k:])
        sched.load_state_dict(pipe.load_checkpoint(path))
        train_steps(pipe, emb, opt, sched, batches[k:])
    assert_same(snapshot(emb, opt), want)


@pytest.mark.parametrize("opt_name", ["adam", "adagrad"])
def test_state_dict_round_trip_and_torch_save(tmp_path, opt_name):
    """Pipeline.state_dict/load_state_dict, also through torch.save + weights_only load."""
    batches = make_batches()
    want = reference(opt_name, batches)
    emb, opt, sched, pipe = make(opt_name, 1)
    with pipe:
        train_steps(pipe, emb, opt, sched, batches[:4])
        torch.save({"pipe": pipe.state_dict(), "sched": sched.state_dict()}, tmp_path / "sd.pt")
    sd = torch.load(tmp_path / "sd.pt", weights_only=True)
    emb2, opt2, sched2, pipe2 = make(opt_name, 1, seed=5)
    pipe2.load_state_dict(sd["pipe"])
    sched2.load_state_dict(sd["sched"])
    with pipe2:
        train_steps(pipe2, emb2, opt2, sched2, batches[4:])
    assert_same(snapshot(emb2, opt2), want)


def test_embeddings_and_optimizer_without_pipeline(tmp_path):
    batches = make_batches()
    want = reference("adam", batches)
    emb, opt, sched, pipe = make("adam", 1)
    with pipe:
        train_steps(pipe, emb, opt, sched, batches[:6])
    ckpt.save(tmp_path / "ck", emb, opt, extra=sched.state_dict())
    emb2 = HostEmbedding(NUM_ROWS, DIM, device="cpu", init="zeros")
    opt2 = torch.optim.Adam(emb2.parameters(), lr=0.01)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=3, gamma=0.5)
    sched2.load_state_dict(ckpt.load(tmp_path / "ck", emb2, opt2))  # binds opt2; the pipeline reuses it
    with Pipeline(emb2, optimizer=opt2, ids="ids") as pipe2:
        train_steps(pipe2, emb2, opt2, sched2, batches[6:])
    assert_same(snapshot(emb2, opt2), want)
    # tables only (evaluation): no optimizer given
    emb3 = HostEmbedding(NUM_ROWS, DIM, device="cpu", init="zeros")
    ckpt.load(tmp_path / "ck", emb3)
    assert torch.equal(emb3.table.tensor(), emb.table.tensor())


def test_before_first_step_and_several_tables(tmp_path):
    """A checkpoint before any step (no state tables yet) and a dict of two tables."""
    embs = {n: HostEmbedding(NUM_ROWS, DIM, device="cpu", generator=torch.Generator().manual_seed(s))
            for n, s in (("in", 1), ("out", 2))}
    opt = torch.optim.Adagrad([embs["in"].weight, embs["out"].weight], lr=0.1)
    pipe = Pipeline(embs, optimizer=opt, ids=lambda b: {"in": b["ids"], "out": b["ids"] % 97})
    pipe.save_checkpoint(tmp_path / "ck")
    man = ckpt.read_manifest(tmp_path / "ck")
    assert [t["name"] for t in man["state"]["tables"]] == ["in", "out"]
    embs2 = {n: HostEmbedding(NUM_ROWS, DIM, device="cpu", init="zeros") for n in ("in", "out")}
    opt2 = torch.optim.Adagrad([embs2["in"].weight, embs2["out"].weight], lr=0.1)
    pipe2 = Pipeline(embs2, optimizer=opt2, ids=lambda b: {"in": b["ids"], "out": b["ids"] % 97})
    pipe2.load_checkpoint(tmp_path / "ck")
    batches = make_batches(6)

    def go(p, e, o):
        with p:
            for step in p.run(batches):
                with step:
                    (loss_fn(e["in"](step.ids["in"]), step.batch["target"])
                     + loss_fn(e["out"](step.ids["out"]), step.batch["target"])).backward()
                    o.step()
                    o.zero_grad()
        return {n: snapshot(e[n], o) for n in e}

    a, b = go(pipe, embs, opt), go(pipe2, embs2, opt2)
    for n in a:
        assert_same(a[n], b[n])


def test_dense_parameters_and_extra_tensors(tmp_path):
    """Other parameters of the optimizer (a dense layer) and tensors in extra round-trip."""
    emb = HostEmbedding(NUM_ROWS, DIM, device="cpu", generator=torch.Generator().manual_seed(0))
    lin = torch.nn.Linear(DIM, 1)
    opt = torch.optim.Adam([{"params": emb.parameters()}, {"params": lin.parameters(), "lr": 0.003}], lr=0.01)
    batches = make_batches(4)
    with Pipeline(emb, optimizer=opt, ids="ids") as pipe:
        for step in pipe.run(batches):
            with step:
                (lin(emb(step.ids)).squeeze(-1) - step.batch["target"].float()).pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
        big = torch.arange(300, dtype=torch.float64).reshape(30, 10)
        extra = {"model": lin.state_dict(), "big": big, "bf": torch.ones(100, dtype=torch.bfloat16) / 3,
                 "t": (1, 2.5, None, "x"), 3: [True, float("inf")]}
        pipe.save_checkpoint(tmp_path / "ck", extra=extra)
    emb2 = HostEmbedding(NUM_ROWS, DIM, device="cpu", init="zeros")
    lin2 = torch.nn.Linear(DIM, 1)
    opt2 = torch.optim.Adam([{"params": emb2.parameters()}, {"params": lin2.parameters(), "lr": 0.5}], lr=0.01)
    got = Pipeline(emb2, optimizer=opt2, ids="ids").load_checkpoint(tmp_path / "ck")
    lin2.load_state_dict(got["model"])
    assert torch.equal(got["big"], big) and got["big"].dtype == torch.float64
    assert torch.equal(got["bf"], extra["bf"]) and got["bf"].dtype == torch.bfloat16
    assert got["t"] == (1, 2.5, None, "x") and got[3] == [True, float("inf")]
    assert opt2.param_groups[1]["lr"] == 0.003
    for p, q in zip(lin.parameters(), lin2.parameters()):
        assert torch.equal(p, q)
        for key in opt.state[p]:
            assert torch.equal(opt.state[p][key], opt2.state[q][key]), key


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_half_tables(tmp_path, dtype):
    emb = HostEmbedding(NUM_ROWS, DIM, dtype=dtype, device="cpu", generator=torch.Generator().manual_seed(0))
    ckpt.save(tmp_path / "ck", emb)
    emb2 = HostEmbedding(NUM_ROWS, DIM, dtype=dtype, device="cpu", init="zeros")
    ckpt.load(tmp_path / "ck", emb2)
    assert torch.equal(emb.table.tensor().view(torch.int16), emb2.table.tensor().view(torch.int16))


# ------------------------------------------------------------------ batch transfer
Pair = namedtuple("Pair", "a b")


@dataclass
class Extra:
    x: torch.Tensor
    tag: str


def test_run_passes_nested_batch_through_on_cpu():
    emb = HostEmbedding(NUM_ROWS, DIM, device="cpu")
    batches = [{"ids": torch.tensor([1, 2, 3]), "nest": [Pair(torch.ones(2), (torch.zeros(1), 5)), Extra(torch.arange(3), "t")]}
               for _ in range(3)]
    with Pipeline(emb, ids="ids") as pipe:
        for step, src in zip(pipe.run(batches), batches):
            with step:
                assert step.batch["ids"] is src["ids"]
                n = step.batch["nest"]
                assert isinstance(n[0], Pair) and n[0].a is src["nest"][0].a and n[0].b[1] == 5
                assert isinstance(n[1], Extra) and n[1].x is src["nest"][1].x and n[1].tag == "t"
                assert emb(step.batch["ids"]).shape == (3, DIM)


# ------------------------------------------------------------------- bad checkpoints
@pytest.fixture
def saved(tmp_path):
    emb, opt, sched, pipe = make("adam", 1)
    with pipe:
        train_steps(pipe, emb, opt, sched, make_batches(3))
        path = pipe.save_checkpoint(tmp_path / "ck")
    return path, snapshot(emb, opt)


def _fresh(opt_name="adam", rows=NUM_ROWS, dim=DIM, dtype=torch.float32):
    emb = HostEmbedding(rows, dim, dtype=dtype, device="cpu", init="zeros")
    opt = OPTIMIZERS[opt_name](emb.parameters())
    return emb, opt, Pipeline(emb, optimizer=opt, ids="ids")


def _table_file(path, key="weight"):
    man = ckpt.read_manifest(path)
    t = man["state"]["tables"][0]
    ref = t["weight"] if key == "weight" else t["row_state"]["tables"][key]
    return os.path.join(path, ref["__tensor__"]["file"])


def _untouched(emb):
    return bool((emb.table.tensor() == 0).all()) and not emb.state_tables


def test_flipped_byte_is_a_checksum_error(saved):
    path, _ = saved
    f = _table_file(path, "exp_avg_sq")
    with open(f, "r+b") as fh:
        fh.seek(os.path.getsize(f) - 17)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x10]))
    emb, opt, pipe = _fresh()
    with pytest.raises(StpipeValueError, match="checksum"):
        pipe.load_checkpoint(path)
    assert _untouched(emb)  # verify="first": refused before anything was written
    emb, opt, pipe = _fresh()
    with pytest.raises(StpipeValueError, match="checksum"):
        pipe.load_checkpoint(path, verify="stream")


def test_many_chunks_checksummed_on_threads(tmp_path, monkeypatch):
    """Small chunks and no inline CRCs: the threaded, multi-chunk paths (as for big tables)."""
    monkeypatch.setattr(ckpt, "_CHUNK", 4096)
    monkeypatch.setattr(ckpt, "_CRC_INLINE", 0)
    emb, opt, sched, pipe = make("adam", 1)
    with pipe:
        train_steps(pipe, emb, opt, sched, make_batches(3))
        path = pipe.save_checkpoint(tmp_path / "ck")
    want = snapshot(emb, opt)
    assert len(ckpt.read_manifest(path)["files"][os.path.basename(_table_file(path))]["crc32"]) == 1 + 8
    for verify in ("first", "stream"):
        emb2, opt2, pipe2 = _fresh()
        pipe2.load_checkpoint(path, verify=verify)
        got = snapshot(emb2, opt2)
        got["lr"] = want["lr"]  # the scheduler is not part of this checkpoint
        assert_same(got, want)
    f = _table_file(path)
    with open(f, "r+b") as fh:
        fh.seek(os.path.getsize(f) - 3 * 4096 - 5)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 1]))
    for verify in ("first", "stream"):
        with pytest.raises(StpipeValueError, match="checksum mismatch in the data chunk 4 "):
            _fresh()[2].load_checkpoint(path, verify=verify)


def test_truncated_and_missing_files(saved):
    path, _ = saved
    f = _table_file(path)
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 8)
    emb, opt, pipe = _fresh()
    with pytest.raises(StpipeValueError, match="truncated"):
        pipe.load_checkpoint(path)
    assert _untouched(emb)
    os.remove(f)
    with pytest.raises(StpipeValueError, match="missing"):
        pipe.load_checkpoint(path)
    with pytest.raises(FileNotFoundError):
        pipe.load_checkpoint(os.path.join(os.path.dirname(path), "nothing"))


@pytest.mark.parametrize("what", ["rows", "dim", "dtype", "optimizer", "no_optimizer", "groups", "names"])
def test_mismatch_is_refused(saved, what):
    path, _ = saved
    if what == "rows":
        emb, opt, pipe = _fresh(rows=NUM_ROWS + 1)
    elif what == "dim":
        emb, opt, pipe = _fresh(dim=DIM * 2)
    elif what == "dtype":
        emb, opt, pipe = _fresh(dtype=torch.float16)
    elif what == "optimizer":
        emb, opt, pipe = _fresh("sgd_momentum")
    elif what == "no_optimizer":
        emb = HostEmbedding(NUM_ROWS, DIM, device="cpu", init="zeros")
        pipe = Pipeline(emb, ids="ids")
    elif what == "groups":
        emb = HostEmbedding(NUM_ROWS, DIM, device="cpu", init="zeros")
        opt = torch.optim.Adam([{"params": emb.parameters()}, {"params": [torch.nn.Parameter(torch.zeros(2))]}])
        pipe = Pipeline(emb, optimizer=opt, ids="ids")
    else:
        emb = HostEmbedding(NUM_ROWS, DIM, device="cpu", init="zeros")
        opt = torch.optim.Adam(emb.parameters())
        pipe = Pipeline({"a": emb}, optimizer=opt, ids={"a": "ids"})
    with pytest.raises(StpipeValueError) as info:
        pipe.load_checkpoint(path)
    print(info.value)
    assert _untouched(emb)


def test_pickled_npy_is_refused(saved):
    path, _ = saved
    f = _table_file(path)
    arr = np.empty((NUM_ROWS, DIM), dtype=object)
    with open(f, "wb") as fh:
        np.save(fh, arr, allow_pickle=True)
    emb, opt, pipe = _fresh()
    with pytest.raises(StpipeValueError, match="unpickling"):
        pipe.load_checkpoint(path)
    # a manifest edited to claim an object dtype is refused too
    man_path = os.path.join(path, ckpt.MANIFEST)
    man = json.load(open(man_path))
    man["state"]["tables"][0]["weight"]["__tensor__"]["dtype"] = "object"
    json.dump(man, open(man_path, "w"))
    with pytest.raises(StpipeValueError, match="unknown dtype"):
        pipe.load_checkpoint(path)
    assert _untouched(emb)


def test_manifest_cannot_point_outside(saved):
    path, _ = saved
    man_path = os.path.join(path, ckpt.MANIFEST)
    man = json.load(open(man_path))
    man["state"]["tables"][0]["weight"]["__tensor__"]["file"] = "../../etc/passwd.npy"
    json.dump(man, open(man_path, "w"))
    with pytest.raises(StpipeValueError, match="bad file name"):
        _fresh()[2].load_checkpoint(path)
    with open(man_path, "w") as fh:
        fh.write("{not json")
    with pytest.raises(StpipeValueError, match="JSON"):
        _fresh()[2].load_checkpoint(path)


def test_guards(tmp_path, saved):
    path, _ = saved
    emb, opt, pipe = _fresh()
    it = pipe.run(make_batches(3))
    step = next(it)
    with step:
        with pytest.raises(StpipeRuntimeError, match="inside a step"):
            pipe.save_checkpoint(tmp_path / "x")
        loss_fn(emb(step.ids), step.batch["target"]).backward()
        opt.step()
    with pytest.raises(StpipeRuntimeError, match="run of the pipeline is active"):
        pipe.load_checkpoint(path)
    it.close()
    pipe.load_checkpoint(path)
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "precious.txt").write_text("keep")
    with pytest.raises(StpipeValueError, match="not an stpipe checkpoint"):
        pipe.save_checkpoint(tmp_path / "user")
    assert (tmp_path / "user" / "precious.txt").read_text() == "keep"
    with pytest.raises(StpipeTypeError, match="cannot store"):
        pipe.save_checkpoint(tmp_path / "y", extra={"f": lambda: 0})
    assert not os.path.exists(tmp_path / "y") and not any(p.name.startswith("y.") for p in tmp_path.iterdir())
    with pytest.raises(StpipeValueError, match="verify"):
        pipe.load_checkpoint(path, verify="never")


def test_save_replaces_and_cleans_up(tmp_path):
    emb = HostEmbedding(NUM_ROWS, DIM, device="cpu", generator=torch.Generator().manual_seed(0))
    p = ckpt.save(tmp_path / "ck", emb, extra=1)
    emb.table.zeros_()
    ckpt.save(tmp_path / "ck", emb, extra=2)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ck"]
    emb2 = HostEmbedding(NUM_ROWS, DIM, device="cpu")
    assert ckpt.load(p, emb2) == 2 and bool((emb2.table.tensor() == 0).all())


def test_checkpoint_folder_has_the_umask_permissions(tmp_path):
    """The checkpoint directory is made like ``mkdir`` makes one (its files too), not
    private to its owner as a temporary directory is."""
    emb = HostEmbedding(NUM_ROWS, DIM, device="cpu")
    mask = os.umask(0o022)
    try:
        p = ckpt.save(tmp_path / "ck", emb)
    finally:
        os.umask(mask)
    assert os.stat(p).st_mode & 0o777 == 0o755
    assert all(os.stat(os.path.join(p, f)).st_mode & 0o777 == 0o644 for f in os.listdir(p))


def test_falls_back_to_old_after_crash_between_renames(tmp_path):
    emb = HostEmbedding(NUM_ROWS, DIM, device="cpu", generator=torch.Generator().manual_seed(0))
    p = ckpt.save(tmp_path / "ck", emb, extra="v1")
    os.rename(p, p + ".old")  # what a crash right after "rename aside" leaves
    emb2 = HostEmbedding(NUM_ROWS, DIM, device="cpu", init="zeros")
    with pytest.warns(RuntimeWarning, match="previous checkpoint"):
        assert ckpt.load(p, emb2) == "v1"
    assert torch.equal(emb2.table.tensor(), emb.table.tensor())
    ckpt.save(p, emb2, extra="v2")  # the next save cleans up
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ck"]


@pytest.mark.parametrize("dense", [False, True], ids=["tables", "with-dense-layer"])
def test_save_landing_during_a_load(tmp_path, monkeypatch, dense):
    """A save to the path being loaded, landing after load's checks: the target gets the
    checkpoint that was checked, or (a dense layer's state read by path) is refused
    untouched; never a mix of the two."""
    def trained(seed, steps):
        emb = HostEmbedding(NUM_ROWS, DIM, device="cpu", generator=torch.Generator().manual_seed(seed))
        lin = torch.nn.Linear(DIM, 100)
        opt = torch.optim.Adam(list(emb.parameters()) + (list(lin.parameters()) if dense else []), lr=0.01)
        pipe = Pipeline(emb, optimizer=opt, ids="ids")
        with pipe:
            for step in pipe.run(make_batches(steps, seed=seed)):
                with step:
                    (lin(emb(step.ids)).sum(-1) - step.batch["target"].float()).pow(2).sum().backward()
                    opt.step()
                    opt.zero_grad()
        return emb, opt, pipe

    path = str(tmp_path / "latest")
    e1, o1, p1 = trained(1, 2)
    p1.save_checkpoint(path)
    e2, o2, p2 = trained(2, 3)
    target, topt, tpipe = trained(3, 1)
    before = snapshot(target, topt)
    real = ckpt._apply

    def apply(*a, **k):
        p2.save_checkpoint(path)  # lands after the headers and checksums were checked
        return real(*a, **k)

    monkeypatch.setattr(ckpt, "_apply", apply)
    if dense:
        with pytest.raises(StpipeValueError, match="checksum mismatch"):
            tpipe.load_checkpoint(path)
        assert_same(snapshot(target, topt), before)
    else:
        tpipe.load_checkpoint(path)
        assert_same(snapshot(target, topt), snapshot(e1, o1))
    monkeypatch.setattr(ckpt, "_apply", real)
    tpipe.load_checkpoint(path)
    assert_same(snapshot(target, topt), snapshot(e2, o2))


@pytest.mark.parametrize("fail", ["aside", "in", "in-new-path"])
def test_failed_rename_leaves_the_previous_checkpoint(tmp_path, monkeypatch, fail):
    """An OSError from save's last renames (moving the old checkpoint aside, moving the new
    one in) leaves what was there under its name and no temporary directory."""
    emb = HostEmbedding(NUM_ROWS, DIM, device="cpu", generator=torch.Generator().manual_seed(0))
    path = str(tmp_path / "ck")
    if fail != "in-new-path":
        ckpt.save(path, emb, extra="v1")
    before = emb.table.tensor().clone()
    emb.table.zeros_()
    real = os.rename

    def rename(a, b):
        a, b = os.fspath(a), os.fspath(b)
        if (b.endswith(".old") if fail == "aside" else os.path.basename(a).startswith("ck.tmp-")):
            raise OSError(5, "injected rename failure")
        return real(a, b)

    monkeypatch.setattr(ckpt.os, "rename", rename)
    with pytest.raises(OSError, match="injected"):
        ckpt.save(path, emb, extra="v2")
    monkeypatch.setattr(ckpt.os, "rename", real)
    assert sorted(x.name for x in tmp_path.iterdir()) == ([] if fail == "in-new-path" else ["ck"])
    if fail != "in-new-path":
        emb2 = HostEmbedding(NUM_ROWS, DIM, device="cpu", init="zeros")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback to ck.old
            assert ckpt.load(path, emb2) == "v1"
        assert torch.equal(emb2.table.tensor(), before)
    assert ckpt.load(ckpt.save(path, emb, extra="v3"), emb) == "v3"  # and saving goes on


# ---------------------------------------------------------------------- crash tests
# One child interpreter imports torch once (single-threaded, so forking it is safe) and
# forks a grandchild per crash; each grandchild is a real process killed with SIGKILL,
# either by itself at a named point of the save protocol or by the child after a delay.
CHILD = textwrap.dedent("""
    import json, os, signal, sys, time, torch
    import stpipe.checkpoint as ckpt
    from stpipe.embedding import HostEmbedding
    from stpipe.pipeline import Pipeline
    torch.set_num_threads(1)
    mode, root, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
    work = sys.argv[4].split(",")

    def build(v):
        emb = HostEmbedding(rows, 16, device="cpu", generator=torch.Generator().manual_seed(v))
        opt = torch.optim.Adam(emb.parameters(), lr=0.01 * (v + 1))
        pipe = Pipeline(emb, optimizer=opt, ids="ids")
        with pipe:  # one step: state tables and scalar state exist
            for step in pipe.run([{"ids": torch.arange(v, v + 50)}]):
                with step:
                    emb(step.ids).pow(2).sum().backward(); opt.step(); opt.zero_grad()
        return pipe

    def crash(name, point):
        if name == point:
            os.kill(os.getpid(), signal.SIGKILL)

    build(0)  # warm up once (lazy imports, probes) so each fork starts fast
    result = {}
    for i, item in enumerate(work):
        path = os.path.join(root, str(i), "ck")
        pid = os.fork()
        if pid == 0:
            try:
                if mode == "points":
                    pipe = build(1)
                    ckpt._crash_point = lambda name: crash(name, item)
                    pipe.save_checkpoint(path, extra={"version": 1})
                else:  # save alternating versions until killed
                    pipes = [build(0), build(1)]
                    k = 1
                    while True:
                        pipes[k % 2].save_checkpoint(path, extra={"version": k % 2})
                        k += 1
            finally:
                os._exit(3)
        if mode == "random":
            deadline = time.monotonic() + 30
            while not os.path.isdir(path) and time.monotonic() < deadline:  # a first save finished
                time.sleep(0.005)
            time.sleep(float(item))
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        result[item] = os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)
    print(json.dumps(result), flush=True)
""")


def _build(v, rows):
    emb = HostEmbedding(rows, 16, device="cpu", generator=torch.Generator().manual_seed(v))
    opt = torch.optim.Adam(emb.parameters(), lr=0.01 * (v + 1))
    pipe = Pipeline(emb, optimizer=opt, ids="ids")
    with pipe:
        for step in pipe.run([{"ids": torch.arange(v, v + 50)}]):
            with step:
                emb(step.ids).pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
    return emb, opt, pipe


def _check_loads_as_one_of(path, expected, rows):
    emb = HostEmbedding(rows, 16, device="cpu", init="zeros")
    opt = torch.optim.Adam(emb.parameters(), lr=0.5)
    pipe = Pipeline(emb, optimizer=opt, ids="ids")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        extra = pipe.load_checkpoint(path)
    v = extra["version"]
    assert_same(snapshot(emb, opt), expected[v])
    return v


def _run_child(tmp_path, mode, rows, work):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.run([sys.executable, str(script), mode, str(tmp_path), str(rows), ",".join(work)],
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])


KILL_POINTS = ["start", "file:1", "file:2", "file:3", "manifest", "old-cleared", "aside", "in", "done"]


def test_sigkill_mid_save_leaves_a_loadable_checkpoint(tmp_path):
    rows = 2000
    expected = {v: snapshot(*_build(v, rows)[:2]) for v in (0, 1)}
    emb, opt, pipe = _build(0, rows)
    for i in range(len(KILL_POINTS)):  # the previous checkpoint, version 0
        pipe.save_checkpoint(tmp_path / str(i) / "ck", extra={"version": 0})
    result = _run_child(tmp_path, "points", rows, KILL_POINTS)
    for i, point in enumerate(KILL_POINTS):
        assert result[point] == signal.SIGKILL, (point, result)
        v = _check_loads_as_one_of(tmp_path / str(i) / "ck", expected, rows)
        # until the new directory is renamed in, the previous version is what loads
        assert v == (1 if point in ("in", "done") else 0), point
        pipe.save_checkpoint(tmp_path / str(i) / "ck", extra={"version": 0})  # saving again cleans up
        assert sorted(os.listdir(tmp_path / str(i))) == ["ck"]


def test_sigkill_at_random_moments(tmp_path):
    rows = 40_000  # ~2.5 MB per table: a save takes a few ms, kills land anywhere in it
    expected = {v: snapshot(*_build(v, rows)[:2]) for v in (0, 1)}
    delays = [f"{d:.3f}" for d in np.random.default_rng(0).uniform(0.01, 0.3, 5)]
    result = _run_child(tmp_path, "random", rows, delays)
    for i, d in enumerate(delays):
        assert result[d] == signal.SIGKILL, result
        _check_loads_as_one_of(tmp_path / str(i) / "ck", expected, rows)

"""GPU tests of checkpoints and batch transfer (``-m gpu``); skipped cleanly without CUDA.

Resume on CUDA is bit-identical to the uninterrupted run, also when saving right after a
step (write-backs still queued on the copy stream) with batches gathered ahead; fused Adam's
``step`` on the device comes back on the device. ``pipe.run`` delivers nested batches on the
GPU with equal values, pinned and pageable sources alike.
"""
from __future__ import annotations

import time
from collections import namedtuple
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from stpipe.embedding import HostEmbedding
from stpipe.pipeline import Pipeline

pytestmark = pytest.mark.gpu

NUM_ROWS = 200_000
DIM = 64

OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1),
}


def batches(steps=16, n=4096, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(steps):
        ids = np.concatenate([(rng.zipf(1.2, n) - 1) % NUM_ROWS, np.arange(i * 512, i * 512 + 1024)])
        out.append({"ids": torch.from_numpy(ids.astype(np.int64)),
                    "target": torch.from_numpy(rng.standard_normal(len(ids)).astype(np.float32))})
    return out


def loss_fn(rows, target):
    coef = torch.linspace(-1, 1, rows.shape[-1], device=rows.device, dtype=rows.dtype)
    return (((torch.tanh(rows) * coef).sum(-1) - target) ** 2).sum()


def make(dev, opt_name, depth, seed=1):
    emb = HostEmbedding(NUM_ROWS, DIM, device=dev, generator=torch.Generator().manual_seed(seed))
    opt = OPTIMIZERS[opt_name](emb.parameters())
    return emb, opt, Pipeline(emb, optimizer=opt, ids="ids", depth=depth)


def train(pipe, emb, opt, data, stop_after=None):
    it = pipe.run(data)
    for i, step in enumerate(it):
        with step:
            assert step.batch["target"].is_cuda
            loss_fn(emb(step.ids), step.batch["target"]).backward()
            opt.step()
            opt.zero_grad()
        if stop_after is not None and i + 1 == stop_after:
            return it
    return None


def snapshot(emb, opt):
    out = {"table": emb.table.tensor().clone()}
    for key, t in emb.state_tables.items():
        out["state:" + key] = t.tensor().clone()
    for key, v in opt.state.get(emb.weight, {}).items():
        if key not in emb.state_tables:
            out["scalar:" + key] = (v.device.type, v.detach().cpu().clone()) if torch.is_tensor(v) else v
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, tuple):
            assert x[0] == y[0], f"{k}: on {x[0]} vs {y[0]}"
            x, y = x[1], y[1]
        if torch.is_tensor(x):
            assert torch.equal(x, y), f"{k}: max diff {(x.double() - y.double()).abs().max()}"
        else:
            assert x == y, k


@pytest.mark.parametrize("depth", [0, 1, 2], ids=lambda d: f"depth{d}")
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_resume_is_bit_identical_on_cuda(tmp_path, cuda_device, opt_name, depth):
    data = batches()
    k = 7
    emb, opt, pipe = make(cuda_device, opt_name, 0)
    with pipe:
        train(pipe, emb, opt, data)
    want = snapshot(emb, opt)

    emb, opt, pipe = make(cuda_device, opt_name, depth)
    it = train(pipe, emb, opt, data, stop_after=k)
    if depth:
        end = time.monotonic() + 5
        while not pipe._inflight and time.monotonic() < end:
            time.sleep(0.005)
        assert pipe._inflight
    path = pipe.save_checkpoint(tmp_path / "ck", extra={"step": k})  # write-backs may be queued
    it.close()
    pipe.close()

    emb2, opt2, pipe2 = make(cuda_device, opt_name, depth, seed=9)
    assert pipe2.load_checkpoint(path) == {"step": k}
    with pipe2:
        train(pipe2, emb2, opt2, data[k:])
    assert_same(snapshot(emb2, opt2), want)


def test_state_dict_round_trip_on_cuda(cuda_device):
    data = batches(6)
    emb, opt, pipe = make(cuda_device, "adam_fused", 1)
    with pipe:
        train(pipe, emb, opt, data[:3])
        sd = pipe.state_dict()
        sd = {**sd, "tables": [{**t, "weight": t["weight"].clone(),
                                "row_state": {**t["row_state"], "tables": {k: v.clone() for k, v in t["row_state"]["tables"].items()}}}
                               for t in sd["tables"]]}
        train(pipe, emb, opt, data[3:])
    want = snapshot(emb, opt)
    emb2, opt2, pipe2 = make(cuda_device, "adam_fused", 1, seed=4)
    pipe2.load_state_dict(sd)
    assert opt2.state[emb2.weight]["step"].is_cuda
    with pipe2:
        train(pipe2, emb2, opt2, data[3:])
    assert_same(snapshot(emb2, opt2), want)


Pair = namedtuple("Pair", "a b")


@dataclass
class Holder:
    x: torch.Tensor
    name: str


@pytest.mark.parametrize("depth", [0, 1, 2], ids=lambda d: f"depth{d}")
def test_batch_arrives_on_cuda(cuda_device, depth):
    emb = HostEmbedding(10_000, 16, device=cuda_device)
    rng = np.random.default_rng(0)
    src = []
    for i in range(8):
        ids = torch.from_numpy(rng.integers(0, 10_000, 300))
        dense = torch.randn(300, 32)
        src.append({"ids": ids, "nest": [Pair(dense, (torch.arange(5).pin_memory(), "s")),
                                         Holder(torch.ones(3, dtype=torch.float16), "h")],
                    "already": torch.full((4,), float(i), device=cuda_device), "n": i})
    with Pipeline(emb, ids="ids", depth=depth) as pipe:
        for step, b in zip(pipe.run(src), src):
            got = step.batch  # read before entering: the current stream waits for the copies
            with step:
                assert got["ids"].is_cuda and torch.equal(got["ids"].cpu(), b["ids"])
                p = got["nest"][0]
                assert isinstance(p, Pair) and p.a.is_cuda and torch.equal(p.a.cpu(), b["nest"][0].a)
                assert p.b[0].is_cuda and torch.equal(p.b[0].cpu(), torch.arange(5)) and p.b[1] == "s"
                h = got["nest"][1]
                assert isinstance(h, Holder) and h.x.is_cuda and h.x.dtype == torch.float16 and h.name == "h"
                assert got["already"] is b["already"] and got["n"] == b["n"]
                # the moved ids take the planned fast path and give the same rows
                assert torch.equal(emb(got["ids"]), emb(step.ids))
    with Pipeline(emb, ids="ids", depth=depth) as pipe:  # to_device=False keeps the batch as given
        for step, b in zip(pipe.run(src, to_device=False), src):
            with step:
                assert step.batch is b

"""Skip-gram with negative sampling on host tables: stpipe against the alternatives.

Batch: 512 centres x (4 positives + 64 negatives), dim 128, Adam (lr 1e-3), two tables
(input and output embeddings) of ``--rows`` rows (default 10M: 2 x 5.12 GB of table and
4 x 5.12 GB of Adam state), ids drawn from Zipf(1.2) (low ids hot). One run measures:

* ``gpu_sparse_adam``: both tables on the GPU, ``nn.Embedding(sparse=True)`` + ``SparseAdam``
  (the ceiling: no transfers at all);
* ``naive_host``: tables and Adam state as ordinary CPU tensors; per step ``torch.unique``,
  ``t[uniq].to(dev)`` for rows and state, Adam on the rows, ``t[uniq] = x.cpu()`` back;
* ``speedtorch_sgd``: SpeedTorch 0.1.6 ``ModelFactory(CPUPinn=True)`` switchers (when
  ``import SpeedTorch`` works) with plain SGD: it moves no optimizer state, so it is a
  lighter workload than every other row (less data per step);
* ``speedtorch_adam``: the same workload as the other rows: SpeedTorch's ``ModelFactory``
  switchers for the tables plus its ``OptimizerFactory(CPUPinn=True)`` switchers for Adam's
  ``exp_avg``/``exp_avg_sq``. SpeedTorch 0.1.6 fails on current PyTorch because its
  ``OptimizerFactory`` seeds ``state['step'] = 0`` (a Python int; PyTorch >= 1.12's Adam
  wants a tensor). The one change made to it: after the factories are built, each
  parameter's ``step`` is replaced by ``torch.tensor(0.0)``, which is what Adam itself
  would have created. Everything else (its syncs, CuPy fancy indexing, no dedup) is as shipped;
* ``compat_sgd`` / ``compat_adam``: the same SpeedTorch code as the two rows above, run
  through ``stpipe.compat.speedtorch`` (no fix needed there);
* ``stpipe_depth0``: stpipe, strictly sequential (plan, gather, step, scatter);
* ``stpipe_depth1``: stpipe with the prefetch thread (batch N+1 planned and gathered while
  N computes), as a user gets it: ``Pipeline``'s defaults, ``prefetch_delay="auto"``
  included (the issue waits 0.3 of the recent step period after its slot frees);
* ``stpipe_depth1_nodelay`` (on request): the same with ``prefetch_delay=0`` (each batch
  issued as soon as its slot frees: the default before 2026-12-04);
* ``stpipe_depth1_delay`` (on request): the same with ``Pipeline(prefetch_delay=...)`` set
  to ``--prefetch-delay-ms`` (default 0.5): the prefetch thread waits that long after a
  slot frees before issuing the next batch;
* ``stpipe_depth2`` (on request): two batches prefetched, so the prefetch thread has a
  step of slack before the training thread waits for it;
* ``stpipe_depth1_fused``: the same with ``torch.optim.Adam(fused=True)`` (one fused
  kernel per step instead of a dozen foreach launches; same update rule);
* ``speedtorch_adam_fused``: ``speedtorch_adam`` with ``torch.optim.Adam(fused=True)`` (its
  ``step`` state then a tensor on the GPU, where fused Adam keeps it): the SpeedTorch row
  ``stpipe_depth1_fused`` is compared with, so both run the same optimizer
  (``ratio_to_speedtorch_adam_fused``);
* ``compute_only`` / ``compute_only_fused``: the user's step alone on GPU-resident working
  rows of each step's size (no tables, no transfers), its lookups' indices of the dtype
  the pipeline gives them (int32 since stop 38): the lower bound of the design;
* a per-step profile of stpipe depth 1 (plan / gather wait / compute / write-back; the
  profile synchronises at each phase, so it is a breakdown, not a speed);
* ``parts`` (on request): where depth 1's time goes without synchronising: each pipeline
  part's CPU and wall time per step on either thread, the user's step by phase beside the
  step alone's phases, and when the prefetch thread's issue runs within the step
  (:func:`run_parts`);
* on request (``--methods``): ``stpipe_depth1_ids_only`` (depth 1 with
  ``pipe.run(batches, to_device=False)``: the batch holds only ids, so the prefetch thread
  moves the planned ids and not the batch's own tensors; slower than the default in the
  H200 run of RESULTS.md), ``stpipe_depth1_switch`` (depth 1 with a 0.2 ms GIL switch
  interval, an experiment), ``stpipe_depth1_gate`` / ``stpipe_depth1_nogate`` (depth 1 with the
  experimental prefetch gate on, ``STPIPE_PREFETCH_GATE=1``, or off, the default: batches
  issued as soon as a slot is free) and ``trace`` (depth 1 under ``torch.profiler`` and cProfile;
  tables written to ``--trace DIR``, default ``OUT/trace``) and ``trace0`` (depth 0 under
  cProfile alone, so every stpipe call is in the profiled thread; ``DIR/depth0``) and
  ``trace_prefetch`` (depth 1 with the profiler started in the prefetch thread;
  ``DIR/prefetch``; on the H200 host's Python 3.12 its table also held the training
  thread's calls, so it shows both threads together).

``--isolate`` runs each method in a fresh process (same batches) and reports them
together: no row then runs after another method in the same process (in one experiment
the same configuration ran 1.31x slower after the ceiling rows than alone). With
``--rounds K`` it does that K times, the methods' order reversed in every other round, and
each row reports medians over its rounds; its ratios are the medians of each round's ratio
against that round's ceiling or SpeedTorch row (isolated runs of one configuration moved by
up to 0.47 ms per step between calls on one machine, so single rounds decide little).

``--interleave N`` instead keeps every method's tables in one process and runs the methods
in turn, in blocks of ``N`` timed steps (after 5 untimed ones), the order reversed in every
other round, every method on the same batches in a round, until each has timed ``--steps``
steps; a ratio to the ceiling is the median of the per-round ratios. On the shared H200
hosts one configuration's speed moved by up to 30% within seconds (RESULTS.md,
2026-12-04), so blocks a fraction of a second apart compare the methods on the same
machine state. It runs ``gpu_sparse_adam``, ``compute_only``, the SpeedTorch and compat rows
and the stpipe rows ``stpipe_depth0``, ``stpipe_depth1``, ``stpipe_depth1_nodelay`` and
``stpipe_depth1_delay``, and the fused-Adam rows ``compute_only_fused``,
``speedtorch_adam_fused`` and ``stpipe_depth1_fused`` (the last over tables of its own)
(their ratios to SpeedTorch are medians of per-block ratios too); its rows report no CPU times. Every
method's tables are in memory at once: at 10M rows each pinned-table method holds about
31 GB of host memory and the ceiling 31 GB of GPU memory.

``--variant NAME=ATTR:VALUE[,ATTR:VALUE...]`` (with ``--interleave``, repeatable) adds an A/B
row ``stpipe_depth1[NAME]``: depth 1 over the same tables as ``stpipe_depth1``, its
``Pipeline`` with those attributes set (values are Python literals), in the same rounds. With
``stpipe_depth1`` among the methods it reports ``minus_stpipe_depth1``: the median and mean
(with its standard error) of the per-block differences in ms/step, and in how many blocks the
variant was faster. For example, whether the ``"auto"`` prefetch delay should wait 0.4 of the
step period instead of 0.3, on the target's own rows::

    python3 benchmarks/train_skipgram.py --rows 10000000 --steps 1000 --interleave 50 \
        --methods gpu_sparse_adam,compute_only,stpipe_depth1,speedtorch_adam \
        --variant f4=_auto_fraction:0.4

Every row also reports CPU time per step of the training thread (``time.thread_time``)
and, for stpipe at depth >= 1, of its prefetch thread (``Pipeline.prefetch_cpu_s``), and
``drain_ms``: from the end of the last step's Python to the end of its GPU work (the final
synchronisations). About one step's GPU work when the GPU keeps up with the CPU; a
backlog of many steps when the GPU is what limits the loop.

Reported: steps/s, ms/step, ratio to the ceiling, peak GPU memory allocated by PyTorch
(``max_memory_allocated``) and device-wide memory in use (``mem_get_info``; this one also
counts CuPy's pool), host RSS. ``--quick`` is tiny (100k rows, 20 steps) and also runs on
a CPU-only machine. ``--out DIR`` writes ``train_skipgram.json`` and ``train_skipgram.log``.

Usage::

    python benchmarks/train_skipgram.py --out /tmp/bench            # full, H200
    python benchmarks/train_skipgram.py --quick --out /tmp/bench    # tiny, anywhere
    python benchmarks/train_skipgram.py --steps 1000 --interleave 50 \
        --methods gpu_sparse_adam,stpipe_depth1 --out /tmp/bench     # paired blocks, H200
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import gc
import json
import math
import os
import platform
import re
import statistics
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Tuple
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F

from stpipe._bench import _cprofile_tables, _round_orders, _speedtorch_step_fix

BATCH, POS, NEG, DIM, LR = 512, 4, 64, 128, 1e-3


# ------------------------------------------------------------------------- utilities
class Log:
    def __init__(self, path: str | None):
        self.f = open(path, "w") if path else None

    def __call__(self, *args: Any) -> None:
        msg = " ".join(str(a) for a in args)
        print(msg, flush=True)
        if self.f:
            self.f.write(msg + "\n")
            self.f.flush()


def rss_gb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def gpu_mem(dev: torch.device) -> Dict[str, float]:
    if dev.type != "cuda":
        return {"gpu_peak_alloc_gb": float("nan"), "gpu_used_gb": float("nan")}
    free, total = torch.cuda.mem_get_info(dev)
    return {
        "gpu_peak_alloc_gb": torch.cuda.max_memory_allocated(dev) / 1e9,
        "gpu_used_gb": (total - free) / 1e9,
    }


def reset_gpu(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def make_batches(rows: int, n: int, seed: int = 0) -> List[Dict[str, torch.Tensor]]:
    """Zipf(1.2) ids (rank = id, so low ids are hot), as int64 CPU tensors."""
    rng = np.random.default_rng(seed)

    def zipf(shape):
        out = rng.zipf(1.2, size=shape) - 1
        bad = out >= rows
        while bad.any():
            out[bad] = rng.zipf(1.2, size=int(bad.sum())) - 1
            bad = out >= rows
        return torch.from_numpy(out.astype(np.int64))

    return [{"centre": zipf((BATCH,)), "pos": zipf((BATCH, POS)), "neg": zipf((BATCH, NEG))} for _ in range(n)]


def numpy_batches(batches: List[Dict[str, torch.Tensor]]) -> List[Dict[str, np.ndarray]]:
    """The batches as SpeedTorch code takes them (numpy ids): the SpeedTorch and compat rows."""
    return [{k: v.numpy() for k, v in b.items()} for b in batches]


def device_batches(batches: List[Dict[str, torch.Tensor]], dev: torch.device) -> List[Dict[str, torch.Tensor]]:
    """The batches already on ``dev``: the ceiling's input (its tables live there)."""
    return [{k: v.to(dev) for k, v in b.items()} for b in batches]


def sgns_loss(u: torch.Tensor, vp: torch.Tensor, vn: torch.Tensor) -> torch.Tensor:
    """u (B, d), vp (B, P, d), vn (B, N, d): negative-sampling loss, mean over the batch."""
    sp = torch.einsum("bd,bpd->bp", u, vp)
    sn = torch.einsum("bd,bnd->bn", u, vn)
    return -(F.logsigmoid(sp).sum() + F.logsigmoid(-sn).sum()) / u.shape[0]


def timed(dev: torch.device, warmup: int, batches, step_fn: Callable[[Dict[str, torch.Tensor]], torch.Tensor]):
    """Run step_fn over batches; time the steps after ``warmup``."""
    losses = []
    t0 = c0 = None
    for i, b in enumerate(batches):
        if i == warmup:
            sync(dev)
            t0 = time.perf_counter()
            c0 = time.thread_time()
        loss = step_fn(b)
        if i == len(batches) - 1:
            t_cpu = time.perf_counter()
        if i in (0, len(batches) - 1):
            losses.append(float(loss.detach()))
    sync(dev)
    t_end = time.perf_counter()
    dt = t_end - t0
    n = len(batches) - warmup
    return {"steps": n, "seconds": dt, "steps_per_s": n / dt, "ms_per_step": 1e3 * dt / n,
            "train_cpu_ms_per_step": 1e3 * (time.thread_time() - c0) / n,
            "drain_ms": 1e3 * (t_end - t_cpu),
            "loss_first": losses[0], "loss_last": losses[-1]}


# --------------------------------------------------------------------------- methods
def _ceiling_step(args, dev):
    """The ceiling's tables, optimizer and step function (batches already on ``dev``)."""
    e_in = torch.nn.Embedding(args.rows, DIM, sparse=True, device=dev)
    e_out = torch.nn.Embedding(args.rows, DIM, sparse=True, device=dev)
    with torch.no_grad():
        e_in.weight.uniform_(-0.5 / DIM, 0.5 / DIM)
        e_out.weight.zero_()
    opt = torch.optim.SparseAdam(list(e_in.parameters()) + list(e_out.parameters()), lr=LR)

    def step(b):
        loss = sgns_loss(e_in(b["centre"]), e_out(b["pos"]), e_out(b["neg"]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def run_ceiling(args, dev, batches):
    step = _ceiling_step(args, dev)
    res = timed(dev, args.warmup, device_batches(batches, dev), step)
    res.update(gpu_mem(dev), host_rss_gb=rss_gb(), note="tables + SparseAdam state on the GPU")
    return res


def run_naive(args, dev, batches):
    rows = args.rows
    tables = {}
    for name in ("in", "out"):
        t = torch.empty(rows, DIM)
        if name == "in":
            t.uniform_(-0.5 / DIM, 0.5 / DIM)
        else:
            t.zero_()
        tables[name] = (t, torch.zeros(rows, DIM), torch.zeros(rows, DIM))
    b1, b2, eps = 0.9, 0.999, 1e-8
    state = {"t": 0}

    def step(b):
        state["t"] += 1
        t = state["t"]
        got = {}
        for name, ids in (("in", b["centre"]), ("out", torch.cat([b["pos"].reshape(-1), b["neg"].reshape(-1)]))):
            uniq, inv = torch.unique(ids, return_inverse=True)
            w, m, v = tables[name]
            p = w[uniq].to(dev).requires_grad_()
            got[name] = (uniq, inv.to(dev), p, m[uniq].to(dev), v[uniq].to(dev))
        u = F.embedding(got["in"][1], got["in"][2])
        ctx = F.embedding(got["out"][1], got["out"][2])
        vp, vn = ctx[: BATCH * POS].view(BATCH, POS, DIM), ctx[BATCH * POS:].view(BATCH, NEG, DIM)
        loss = sgns_loss(u, vp, vn)
        loss.backward()
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        for name, (uniq, _, p, m, v) in got.items():
            with torch.no_grad():
                g = p.grad
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
                p.addcdiv_(m, denom, value=-LR / bc1)
                w, mh, vh = tables[name]
                w[uniq] = p.detach().cpu()
                mh[uniq] = m.cpu()
                vh[uniq] = v.cpu()
        return loss

    res = timed(dev, args.warmup, batches, step)
    res.update(gpu_mem(dev), host_rss_gb=rss_gb(),
               note="pageable CPU tensors; torch.unique dedup; t[uniq].to(dev) / t[uniq] = x.cpu(); Adam state too")
    return res


def run_speedtorch(args, dev, batches, adam: bool = False, compat: bool = False, fused: bool = False):
    """SpeedTorch's documented skip-gram pattern (speedtorch-api.md): dummy embeddings of
    batch size, ``ModelFactory`` switchers (and ``OptimizerFactory`` ones for Adam) around
    the step. ``compat=True`` runs the very same code through ``stpipe.compat.speedtorch``
    (the one-line import change), with no fix applied to it. ``fused=True``: its Adam is
    ``torch.optim.Adam(fused=True)`` (the baseline of ``stpipe_depth1_fused``)."""
    step = _speedtorch_step(args, dev, adam, compat, fused)
    if isinstance(step, dict):
        return step  # skipped
    res = timed(dev, args.warmup, numpy_batches(batches), step)
    res.update(gpu_mem(dev), host_rss_gb=rss_gb(), note=_speedtorch_note(adam, compat, fused))
    return res


def _speedtorch_note(adam: bool, compat: bool, fused: bool = False) -> str:
    if compat:
        return (f"stpipe.compat.speedtorch, SpeedTorch's code unchanged, {'Adam' if adam else 'SGD'}: "
                "duplicate ids deduplicated (summed gradients, one write-back)")
    if adam:
        return (f"SpeedTorch 0.1.6 ModelFactory + OptimizerFactory (CPUPinn=True), Adam{'(fused=True)' * fused} "
                "lr 1e-3; its int 'step' state replaced by a tensor (the one change); no dedup")
    return ("SpeedTorch 0.1.6 ModelFactory(CPUPinn=True) + SGD: no optimizer state moves "
            "(lighter workload); no dedup")


def _speedtorch_kind(name: str) -> Tuple[bool, bool, bool]:
    """``(adam, compat, fused)`` of a SpeedTorch or compat row's name, the arguments of
    :func:`_speedtorch_step`, :func:`run_speedtorch` and :func:`_speedtorch_note`
    (``speedtorch_adam_fused``: Adam, SpeedTorch itself, fused)."""
    return name.endswith(("adam", "adam_fused")), name.startswith("compat"), name.endswith("_fused")


def _speedtorch_step(args, dev, adam: bool, compat: bool, fused: bool = False):
    """The SpeedTorch-pattern model, switchers and step function (a batch of numpy ids in,
    the loss out), or ``{"skipped": why}`` when SpeedTorch cannot run here. ``fused``: Adam
    with ``fused=True``."""
    if compat:
        import stpipe.compat.speedtorch as SpeedTorch  # noqa: N813
    else:
        try:
            import SpeedTorch  # noqa: N813
        except Exception as exc:  # not installed, or CuPy missing/broken
            return {"skipped": f"import SpeedTorch failed: {type(exc).__name__}: {exc}"}
        if dev.type != "cuda":
            return {"skipped": "SpeedTorch needs CUDA (CuPy)"}

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.u_embeddings = torch.nn.Embedding(BATCH, DIM).to(dev)
            self.v_embeddings = torch.nn.Embedding(BATCH * (POS + NEG), DIM).to(dev)

        def forward(self, u_dummy, pos_dummy, neg_dummy):
            return sgns_loss(self.u_embeddings(u_dummy), self.v_embeddings(pos_dummy), self.v_embeddings(neg_dummy))

    model = Model()
    u_sw = SpeedTorch.ModelFactory(model.u_embeddings, total_classes=args.rows, embed_dimension=DIM, CPUPinn=True)
    u_sw.uniformDistributionInit(-0.5 / DIM, 0.5 / DIM)
    v_sw = SpeedTorch.ModelFactory(model.v_embeddings, total_classes=args.rows, embed_dimension=DIM, CPUPinn=True)
    v_sw.zerosInit()
    u_sws, v_sws = [u_sw], [v_sw]
    if adam:
        opt = torch.optim.Adam(model.parameters(), lr=LR, **({"fused": True} if fused else {}))
        u_opt = SpeedTorch.OptimizerFactory(opt, args.rows, DIM, model, "u_embeddings", CPUPinn=True)
        v_opt = SpeedTorch.OptimizerFactory(opt, args.rows, DIM, model, "v_embeddings", CPUPinn=True)
        if not compat:
            _speedtorch_step_fix(opt)
        u_opt.optInit()
        v_opt.optInit()
        u_sws.append(u_opt)
        v_sws.append(v_opt)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pos_d, neg_d = v_sw.variableTransformer(BATCH, POS, NEG)
    pos_d, neg_d = torch.as_tensor(pos_d, device=dev).long(), torch.as_tensor(neg_d, device=dev).long()
    u_d = torch.arange(BATCH, device=dev)

    def step(b):
        for s in u_sws:
            s.beforeForwardPass(b["centre"])
        for s in v_sws:
            s.beforeForwardPass(b["pos"], b["neg"])
        loss = model(u_d, pos_d, neg_d)
        opt.zero_grad()
        loss.backward()
        opt.step()
        for s in u_sws:
            s.afterOptimizerStep(b["centre"])
        for s in v_sws:
            s.afterOptimizerStep(b["pos"], b["neg"])
        return loss

    return step


def _compute_only_work(args, dev, batches) -> List[Tuple[int, torch.Tensor, int, torch.Tensor, torch.Tensor]]:
    """The step alone's per-batch work items: ``(k_in, centre inverse, k_out, positives'
    inverse, negatives' inverse)``, the inverses on ``dev``."""
    from stpipe.pipeline import Pipeline
    from stpipe.planner import plan as _plan

    # the lookups' index dtype the pipeline gives the same step (int32 since stop 38)
    idx_dtype = torch.int32 if Pipeline._inv32 else torch.int64
    work = []
    for b in batches:
        pin = _plan(b["centre"].numpy(), args.rows)
        ctx = torch.cat([b["pos"].reshape(-1), b["neg"].reshape(-1)]).numpy()
        pout = _plan(ctx, args.rows)
        inv = torch.as_tensor(pout.inverse, device=dev, dtype=idx_dtype)
        work.append((pin.num_unique, torch.as_tensor(pin.inverse, device=dev, dtype=idx_dtype), pout.num_unique,
                     inv[: BATCH * POS].view(BATCH, POS), inv[BATCH * POS:].view(BATCH, NEG)))
    return work


def _compute_only_rows(work, dev, fused=False):
    """The step alone's fixed working rows (as many per table as the largest batch's
    unique ids) and their Adam: ``(w_in, w_out, opt)``."""
    kmax_in = max(w[0] for w in work)
    kmax_out = max(w[2] for w in work)
    w_in = torch.nn.Parameter(torch.empty(kmax_in, DIM, device=dev).uniform_(-0.5 / DIM, 0.5 / DIM))
    w_out = torch.nn.Parameter(torch.zeros(kmax_out, DIM, device=dev))
    opt = torch.optim.Adam([w_in, w_out], lr=LR, **({"fused": True} if fused else {}))
    return w_in, w_out, opt


def _compute_only_step(args, dev, batches, fused=False):
    """The compute-only step function and its per-batch work items (see
    :func:`run_compute_only`)."""
    work = _compute_only_work(args, dev, batches)
    w_in, w_out, opt = _compute_only_rows(work, dev, fused)

    def step(w):
        k_in, i_in, k_out, i_pos, i_neg = w
        loss = sgns_loss(F.embedding(i_in, w_in), F.embedding(i_pos, w_out), F.embedding(i_neg, w_out))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step, work


def run_compute_only(args, dev, batches, fused=False):
    """The lower bound of any working-rows design: the user's step (forward, backward,
    dense Adam) on GPU-resident working rows, no tables, no transfers. The working rows
    are fixed: as many per table as the largest batch's unique ids (dense Adam steps all
    of them). Each step's plan (the inverse) is precomputed on the device."""
    step, work = _compute_only_step(args, dev, batches, fused)
    res = timed(dev, args.warmup, work, step)
    res.update(gpu_mem(dev), host_rss_gb=rss_gb(),
               note="lower bound: user step on fixed GPU working rows (max k per table), dense Adam")
    return res


class _Stpipe:
    """One pair of stpipe tables shared by the depth-0, depth-1 and profile runs."""

    def __init__(self, args, dev, fused=False):
        from stpipe.embedding import HostEmbedding
        from stpipe.pipeline import Pipeline

        self.Pipeline = Pipeline
        lo = 0.5 / DIM
        kw = {} if args.backend is None else {"backend": args.backend}
        t0 = time.perf_counter()
        self.e_in = HostEmbedding(args.rows, DIM, device=dev, init=lambda t: t.uniform_(-lo, lo), **kw)
        self.e_out = HostEmbedding(args.rows, DIM, device=dev, init="zeros", **kw)
        self.opt = torch.optim.Adam(list(self.e_in.parameters()) + list(self.e_out.parameters()), lr=LR,
                                    **({"fused": True} if fused else {}))
        self.setup_s = time.perf_counter() - t0

    def pipeline(self, depth, profile=False, prefetch_delay="auto"):
        """A pipeline over the two tables (``step.ids``: ``in`` the centres, ``out`` the
        positives and negatives)."""
        return self.Pipeline(
            {"in": self.e_in, "out": self.e_out}, optimizer=self.opt, depth=depth, profile=profile,
            ids=lambda b: {"in": b["centre"], "out": (b["pos"], b["neg"])},
            prefetch_delay=prefetch_delay,
        )

    def train(self, step):
        """The user's step inside ``with step`` (returns the loss)."""
        with step:
            pos, neg = step.ids["out"]
            loss = sgns_loss(self.e_in(step.ids["in"]), self.e_out(pos), self.e_out(neg))
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
        return loss

    def run(self, args, dev, batches, depth, profile=False, trace=None, trace_ops=True,
            trace_prefetch=None, to_device=True, prefetch_delay="auto"):
        """``trace``: a directory; profile the timed steps with torch.profiler and
        cProfile (training thread) and write the tables there. ``trace_prefetch``: a
        directory; run the prefetch thread under cProfile (all its steps, warm-up
        included) and write its tables there. ``to_device``: passed to
        ``Pipeline.run`` (False: only the planned ids move, not the batch's tensors)."""
        e_in, e_out = self.e_in, self.e_out
        tracer = None
        pipe = self.pipeline(depth, profile=profile, prefetch_delay=prefetch_delay)
        if trace_prefetch:
            pipe._producer = _profiled(pipe._producer, trace_prefetch)
        losses, t0 = [], None
        with pipe:
            for step in pipe.run(batches, to_device=to_device):
                if step.index == args.warmup:
                    sync(dev)
                    t0 = time.perf_counter()
                    c0, p0 = time.thread_time(), pipe.prefetch_cpu_s
                    if trace:
                        tracer = _Tracer(dev, ops=trace_ops)
                loss = self.train(step)
                if step.index == len(batches) - 1:
                    t_cpu = time.perf_counter()
                if step.index in (0, len(batches) - 1):
                    losses.append(float(loss.detach()))
            pipe.synchronize()
            sync(dev)
            c1 = time.thread_time()
            t_drained = time.perf_counter()
        dt = time.perf_counter() - t0  # the pipeline's close included, as before drain_ms
        if tracer is not None:
            tracer.finish(trace)
        decisions = {}
        for name, emb in (("in", e_in), ("out", e_out)):
            for tname, t in [("rows", emb.table), *emb.state_tables.items()]:
                mover = getattr(t, "_mover", None)
                for key, (chosen, times) in getattr(mover, "decisions", {}).items():
                    decisions[str(key)] = {"chosen": chosen, "times_ms": {k: round(v * 1e3, 3) for k, v in times.items()}}
        n = len(batches) - args.warmup
        res = {"steps": n, "seconds": dt, "steps_per_s": n / dt, "ms_per_step": 1e3 * dt / n,
               "train_cpu_ms_per_step": 1e3 * (c1 - c0) / n,
               "prefetch_cpu_ms_per_step": 1e3 * (pipe.prefetch_cpu_s - p0) / n,
               "drain_ms": 1e3 * (t_drained - t_cpu),
               "loss_first": losses[0], "loss_last": losses[-1], "stats": dict(pipe.stats),
               "backend": getattr(e_in.table, "backend", None), "auto_decisions": decisions,
               "prefetch_delay": (pipe.prefetch_delay if isinstance(pipe.prefetch_delay, str)
                                  else f"{1e3 * pipe.prefetch_delay:g} ms"),
               "waited_ms_per_step": 1e3 * pipe.stats["delayed_s"] / max(1, pipe.stats["steps"])}
        res.update(gpu_mem(dev), host_rss_gb=rss_gb())
        if trace:
            res["trace"] = trace
        if profile:
            recs = pipe.profile[args.warmup:]
            res["profile_ms"] = {k: float(np.median([r[k] for r in recs])) for k in
                                 ("plan_ms", "wait_ms", "compute_ms", "writeback_ms")}
        return res


class _Marks:
    """Wall time between named marks of a step (``perf_counter``), per phase, while on."""

    def __init__(self) -> None:
        self.on = False
        self.t = None
        self.step_start = 0.0
        self.acc: Dict[str, List[float]] = {}

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        if self.on and self.t is not None:
            self.acc.setdefault(name, []).append(1e6 * (now - self.t))
        if name == "loop":
            self.step_start = now
        self.t = now

    def medians(self) -> Dict[str, float]:
        return {k: round(statistics.median(v), 1) for k, v in self.acc.items()}


#: what ``parts`` accounts: the pipeline's methods and the helpers they call, by thread
_PARTS_METHODS = ("_prepare", "_issue", "_upload", "_upload_lean", "_gather", "_stage", "_wait_delay",
                  "_enter", "_exit", "_write_back", "_carry", "_launch_paired", "_claim_batch")
_PARTS_RUN = ("take_slot", "put", "free")
_PARTS_FUNCTIONS = ("overlap", "_plan", "_finish", "_set_working", "_concat_ids", "_inverse_host",
                    "_map_tensors", "_set_aliases", "_host_tensors")


def run_parts(args, dev, batches, st: "_Stpipe") -> Dict[str, Any]:
    """``parts``: where depth 1's time goes, without synchronising (the step is CPU-bound,
    so a profile that synchronises or one that slows every Python call says little).

    Each pipeline method and helper in ``_PARTS_*`` is wrapped for the timed steps: its
    thread's CPU time (``time.thread_time_ns``), wall time and calls, per step, by thread
    (nested parts are inside their callers' figures). The user's step is timed by phase
    (wall, median us: the loop between steps, entry, forward with the lookups, backward,
    ``opt.step()``, ``zero_grad()``, exit), and so is the step alone (``compute_only``'s
    step on fixed working rows), so phase by phase the difference is what the pipeline
    adds. ``issue_start_us`` / ``issue_end_us``: when the prefetch thread's issue began and
    ended, after the start of the training thread's step during which it began.
    ``ms_per_step`` is the time per step under these wrappers, so it is not a speed: the
    speed table leaves this row out."""
    from collections import defaultdict

    import stpipe.pipeline as P

    acc: Dict[Tuple[str, str], List[int]] = defaultdict(lambda: [0, 0, 0])
    marks = _Marks()
    issue_at: Dict[str, List[float]] = {"issue_start_us": [], "issue_end_us": []}

    def wrapped(fn, label):
        def part(*a, **k):
            if not marks.on:
                return fn(*a, **k)
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                r = acc[("training" if threading.current_thread() is threading.main_thread() else "prefetch",
                         label)]
                r[0] += time.thread_time_ns() - c0
                r[1] += time.perf_counter_ns() - t0
                r[2] += 1
        return part

    def issue(fn):
        def timed_issue(self, flight, run):
            ref = marks.step_start
            a = time.perf_counter() - ref
            try:
                return fn(self, flight, run)
            finally:
                if marks.on:
                    issue_at["issue_start_us"].append(1e6 * a)
                    issue_at["issue_end_us"].append(1e6 * (time.perf_counter() - ref))
        return timed_issue

    # the step alone, by phase
    work = _compute_only_work(args, dev, batches)
    w_in, w_out, opt = _compute_only_rows(work, dev)
    for i, (_, i_in, _, i_pos, i_neg) in enumerate(work):
        if i == args.warmup:
            sync(dev)
            marks.on = True
        marks("loop")
        loss = sgns_loss(F.embedding(i_in, w_in), F.embedding(i_pos, w_out), F.embedding(i_neg, w_out))
        marks("forward")
        loss.backward()
        marks("backward")
        opt.step()
        marks("opt_step")
        opt.zero_grad()
        marks("zero_grad")
    sync(dev)
    alone = marks.medians()
    marks.on, marks.t, marks.acc = False, None, {}

    def train(step):
        marks("loop")
        with step:
            marks("entry")
            pos, neg = step.ids["out"]
            loss = sgns_loss(st.e_in(step.ids["in"]), st.e_out(pos), st.e_out(neg))
            marks("forward")
            loss.backward()
            marks("backward")
            st.opt.step()
            marks("opt_step")
            st.opt.zero_grad()
            marks("zero_grad")
        marks("exit")

    with contextlib.ExitStack() as patches:
        for name in _PARTS_METHODS:
            if hasattr(P.Pipeline, name):
                fn = getattr(P.Pipeline, name)
                patches.enter_context(mock.patch.object(P.Pipeline, name, wrapped(fn, name)))
        patches.enter_context(mock.patch.object(P.Pipeline, "_issue", issue(P.Pipeline._issue)))
        for name in _PARTS_RUN:
            patches.enter_context(mock.patch.object(P._Run, name, wrapped(getattr(P._Run, name), name)))
        for name in _PARTS_FUNCTIONS:
            patches.enter_context(mock.patch.object(P, name, wrapped(getattr(P, name), name)))
        pipe = st.pipeline(1)
        with pipe:
            t0 = c0 = p0 = None
            for step in pipe.run(batches):
                if step.index == args.warmup:
                    sync(dev)
                    marks.on = True
                    t0, c0, p0 = time.perf_counter(), time.thread_time(), pipe.prefetch_cpu_s
                train(step)
            sync(dev)
            marks.on = False
    n = len(batches) - args.warmup
    depth1 = marks.medians()
    res: Dict[str, Any] = {
        "steps": n, "ms_per_step": 1e3 * (time.perf_counter() - t0) / n,
        "train_cpu_us_per_step": 1e6 * (time.thread_time() - c0) / n,
        "prefetch_cpu_us_per_step": 1e6 * (pipe.prefetch_cpu_s - p0) / n,
        "phases_us": {"depth1": depth1, "step_alone": alone,
                      "depth1_minus_step_alone": {k: round(v - alone[k], 1) for k, v in depth1.items() if k in alone}},
        "parts_us_per_step": {f"{th}:{label}": {"cpu": round(v[0] / 1e3 / n, 1), "wall": round(v[1] / 1e3 / n, 1),
                                                "calls": round(v[2] / n, 2)}
                              for (th, label), v in sorted(acc.items())},
    }
    for k, v in issue_at.items():
        if v:
            res["phases_us"][k] = round(statistics.median(v), 1)
    res.update(gpu_mem(dev), host_rss_gb=rss_gb())
    return res


#: methods whose result row is named otherwise than the method
_RESULT_KEYS = {"profile": "stpipe_depth1_profile", "trace": "stpipe_depth1_trace",
                "parts": "stpipe_depth1_parts"}

#: the SpeedTorch rows the stpipe and compat rows are also compared with, where they ran
SPEEDTORCH_BASES = ("speedtorch_adam", "speedtorch_sgd", "speedtorch_adam_fused")
#: every row that runs SpeedTorch's pattern (:func:`run_speedtorch`): SpeedTorch itself and
#: the same code through the compat layer
SPEEDTORCH_ROWS = SPEEDTORCH_BASES + ("compat_sgd", "compat_adam")


def _baselines(name: str):
    """``(key, base)`` for each row ``name`` gets a ratio to: every row to the ceiling
    (``ratio_to_ceiling``), the stpipe and compat rows also to SpeedTorch's
    (``ratio_to_speedtorch_adam`` / ``_sgd`` / ``_adam_fused``); never a row to itself."""
    for base in ("gpu_sparse_adam",) + SPEEDTORCH_BASES:
        if name == base or (base != "gpu_sparse_adam" and not name.startswith(("stpipe", "compat"))):
            continue
        yield ("ratio_to_ceiling" if base == "gpu_sparse_adam" else f"ratio_to_{base}"), base


#: methods ``--interleave`` can run (tables of all of them live in one process)
INTERLEAVE_METHODS = ("gpu_sparse_adam", "compute_only", "speedtorch_sgd", "speedtorch_adam", "compat_sgd",
                      "compat_adam", "stpipe_depth0", "stpipe_depth1", "stpipe_depth1_nodelay",
                      "stpipe_depth1_delay", "compute_only_fused", "speedtorch_adam_fused",
                      "stpipe_depth1_fused")
#: steps at the start of each interleaved block that are not timed (a stpipe block starts
#: a new ``Pipeline.run``: its prefetch thread starts and its first gather is not overlapped)
INTERLEAVE_SKIP = 5


def _stpipe_block(st: "_Stpipe", pipe: Any, batches, dev) -> Callable[[List[int]], float]:
    """A block of ``pipe`` (over ``st``'s tables) for :func:`run_interleaved`: one
    ``pipe.run`` over the batches ``idx``, timed from its step ``INTERLEAVE_SKIP`` to the
    end of its last step's GPU work."""
    def run_block(idx):
        t0 = t1 = None
        for step in pipe.run([batches[j] for j in idx]):
            if step.index == INTERLEAVE_SKIP:
                sync(dev)
                t0 = time.perf_counter()
            st.train(step)
            if step.index == len(idx) - 1:
                sync(dev)
                t1 = time.perf_counter()
        return t1 - t0
    return run_block


#: ``--variant NAME=ATTR:VALUE[,ATTR:VALUE...]``
_VARIANT = re.compile(r"^([A-Za-z0-9_.-]+)=(.+)$")


def parse_variant(spec: str) -> Tuple[str, Dict[str, Any]]:
    """``NAME=ATTR:VALUE[,ATTR:VALUE...]`` -> ``(NAME, {ATTR: VALUE})``, each VALUE a
    Python literal (``0.4``, ``False``, ``'auto'``). Raises ValueError saying what was
    expected."""
    m = _VARIANT.match(spec)
    if m is None:
        raise ValueError(f"expected NAME=ATTR:VALUE[,ATTR:VALUE...], got {spec!r}")
    name, body = m.groups()
    attrs: Dict[str, Any] = {}
    for item in body.split(","):
        attr, sep, text = item.partition(":")
        attr = attr.strip()
        if not sep or not attr.isidentifier():
            raise ValueError(f"variant {name!r}: expected ATTR:VALUE, got {item!r}")
        try:
            attrs[attr] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"variant {name!r}: the value of {attr} must be a Python literal "
                             f"(0.4, False, 'auto'), got {text.strip()!r}") from None
    return name, attrs


def variant_row(name: str) -> str:
    """The result row of ``--variant NAME``."""
    return f"stpipe_depth1[{name}]"


def _paired_difference(base: List[float], other: List[float]) -> Dict[str, Any]:
    """``other - base`` per block (ms/step): median, mean and its standard error, and in
    how many blocks ``other`` was faster."""
    d = [1e3 * (o - b) for b, o in zip(base, other)]
    return {"median_ms": statistics.median(d), "mean_ms": statistics.mean(d),
            "se_ms": statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else None,
            "blocks_faster": sum(x < 0 for x in d), "blocks": len(d)}


def run_interleaved(args, dev, batches, methods: List[str], log) -> Dict[str, Any]:
    """``--interleave N``: every method's tables in this one process, the methods run in
    turn for blocks of ``N`` timed steps (after ``INTERLEAVE_SKIP`` untimed ones), the
    order reversed in every other round, each round on the same batches for every method,
    until each method has timed ``--steps`` steps. Machine speed moves by up to 30% within
    seconds on the shared H200 hosts (RESULTS.md, 2026-12-04 17:34); blocks next to each
    other see the same machine, so a method's ratio to the ceiling is the median of its
    per-round ratios (likewise to SpeedTorch's rows for the stpipe and compat rows). Each
    block is timed between two device synchronisations. A SpeedTorch row that cannot run
    here is reported as skipped and left out of the rounds.

    ``args.variant`` (``--variant`` as ``main`` parsed it with :func:`parse_variant`:
    ``(name, attributes)`` pairs): each adds a depth-1
    row over the shared tables whose ``Pipeline`` has the given attributes set (an A/B
    of the library's private switches, e.g. ``_auto_fraction:0.4``), run in the same
    rounds; with ``stpipe_depth1`` in the rounds too, the row reports its paired
    difference to it (``minus_stpipe_depth1``)."""
    bad = [m for m in methods if m not in INTERLEAVE_METHODS]
    if bad:
        raise SystemExit(f"--interleave runs {', '.join(INTERLEAVE_METHODS)}; got {', '.join(bad)}")
    block = args.interleave
    runs: Dict[str, Callable[[List[int]], float]] = {}
    closers = []
    skipped: Dict[str, Any] = {}
    st = None

    def serial(step, prepared):
        """A block of a serial loop: ``step`` over the batches ``idx`` of ``prepared``
        (``batches`` as this method takes them)."""
        def run_block(idx):
            t0 = None
            for i, j in enumerate(idx):
                if i == INTERLEAVE_SKIP:
                    sync(dev)
                    t0 = time.perf_counter()
                step(prepared[j])
            sync(dev)
            return time.perf_counter() - t0
        return run_block

    for m in methods:
        if m in SPEEDTORCH_ROWS:
            step = _speedtorch_step(args, dev, *_speedtorch_kind(m))
            if isinstance(step, dict):
                skipped[m] = step
                log(f"   {m}: {step['skipped']}")
                continue
            runs[m] = serial(step, numpy_batches(batches))
        elif m == "gpu_sparse_adam":
            runs[m] = serial(_ceiling_step(args, dev), device_batches(batches, dev))
        elif m in ("compute_only", "compute_only_fused"):
            runs[m] = serial(*_compute_only_step(args, dev, batches, fused=m.endswith("_fused")))
        elif m == "stpipe_depth1_fused":  # its own tables: fused Adam's state is its own
            stf = _Stpipe(args, dev, fused=True)
            log(f"stpipe tables (fused Adam) ready in {stf.setup_s:.1f} s")
            pipe = stf.pipeline(1)
            closers.append(pipe.close)
            runs[m] = _stpipe_block(stf, pipe, batches, dev)
        else:
            if st is None:
                st = _Stpipe(args, dev)
                log(f"stpipe tables ready in {st.setup_s:.1f} s")
            depth = 0 if m == "stpipe_depth0" else 1
            delay = {"stpipe_depth1_delay": args.prefetch_delay_ms / 1e3,
                     "stpipe_depth1_nodelay": 0.0}.get(m, "auto")
            pipe = st.pipeline(depth, prefetch_delay=delay)
            closers.append(pipe.close)
            runs[m] = _stpipe_block(st, pipe, batches, dev)
    variants: List[Tuple[str, Dict[str, Any]]] = getattr(args, "variant", None) or []
    for name, attrs in variants:
        if st is None:
            st = _Stpipe(args, dev)
            log(f"stpipe tables ready in {st.setup_s:.1f} s")
        pipe = st.pipeline(1)
        closers.append(pipe.close)
        for attr, value in attrs.items():
            if not hasattr(pipe, attr):
                raise SystemExit(f"--variant {name}: Pipeline has no attribute {attr!r}")
            setattr(pipe, attr, value)
        runs[variant_row(name)] = _stpipe_block(st, pipe, batches, dev)
    variant_of = {variant_row(n): attrs for n, attrs in variants}
    methods = [m for m in methods if m in runs] + list(variant_of)
    n = len(batches)
    per = block + INTERLEAVE_SKIP
    rounds = max(1, -(-args.steps // block))
    times: Dict[str, List[float]] = {m: [] for m in methods}
    try:
        for m in methods:  # warm-up: one block each
            runs[m]([i % n for i in range(max(per, args.warmup))])
        for r in range(rounds):
            order = methods if r % 2 == 0 else methods[::-1]
            idx = [(r * per + i) % n for i in range(per)]
            for m in order:
                times[m].append(runs[m](idx) / block)
    finally:
        for close in closers:
            close()
    out: Dict[str, Any] = {}
    for m in methods:
        ms = [1e3 * t for t in times[m]]
        med = statistics.median(ms)
        row: Dict[str, Any] = {"steps": rounds * block, "ms_per_step": med, "steps_per_s": 1e3 / med,
                               "blocks_ms_per_step": [round(x, 4) for x in ms], "interleave": block}
        for key, base in _baselines(m):
            if base not in times:
                continue
            ratios = [b / t for b, t in zip(times[base], times[m])]
            row[key] = statistics.median(ratios)
            row[f"blocks_{key}"] = [round(x, 4) for x in ratios]
            row[f"blocks_faster_than_{key[len('ratio_to_'):]}"] = sum(x >= 1.0 for x in ratios)
        if m in SPEEDTORCH_ROWS:
            row["note"] = _speedtorch_note(*_speedtorch_kind(m))
        variant = variant_of.get(m)
        if variant is not None:
            row["variant"] = {k: repr(v) for k, v in variant.items()}
            if "stpipe_depth1" in times:
                row["minus_stpipe_depth1"] = _paired_difference(times["stpipe_depth1"], times[m])
        row.update(gpu_mem(dev), host_rss_gb=rss_gb())
        out[m] = row
    out.update(skipped)
    return out


def _profiled(fn, out_dir):
    """``fn`` run with a cProfile started in its thread (on Python 3.12 the table also
    held other threads' calls); on return the tables go to
    ``out_dir/prefetch_cprofile.txt``."""
    def wrapped(*a, **k):
        import cProfile

        cp = cProfile.Profile()
        cp.enable()
        try:
            return fn(*a, **k)
        finally:
            cp.disable()
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, "prefetch_cprofile.txt"), "w") as f:
                f.write(_cprofile_tables(cp))
    return wrapped


def _run_isolated(args, methods: List[str], log) -> Dict[str, Any]:
    """``--isolate``: each method in a fresh ``python train_skipgram.py`` process (the same
    arguments, one method), its results read back from its JSON; a process that fails is
    reported as that method's error."""
    import subprocess
    import tempfile

    results: Dict[str, Any] = {}
    for m in methods:
        with tempfile.TemporaryDirectory(dir=args.out) as d:
            cmd = [sys.executable, os.path.abspath(__file__), "--rows", str(args.rows),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--methods", m,
                   "--out", d]
            if args.quick:
                cmd.append("--quick")
            if args.backend is not None:
                cmd += ["--backend", args.backend]
            if args.trace is not None:
                cmd += ["--trace", args.trace]
            if args.uva_blocks_per_sm is not None:
                cmd += ["--uva-blocks-per-sm", str(args.uva_blocks_per_sm)]
            cmd += ["--prefetch-delay-ms", str(args.prefetch_delay_ms)]
            log(f"-- {m} (own process)")
            proc = subprocess.run(cmd, capture_output=True, text=True)
            path = os.path.join(d, "train_skipgram.json")
            if proc.returncode != 0 or not os.path.exists(path):
                tail = (proc.stdout + proc.stderr)[-2000:]
                results[m] = {"error": f"process exited {proc.returncode}: {tail}"}
                log(f"   {m} failed: exit {proc.returncode}")
                continue
            with open(path) as f:
                got = json.load(f)["results"]
            for name, r in got.items():
                r.pop("ratio_to_ceiling", None)
                results[name] = r
                log(f"   {json.dumps({k: v for k, v in r.items() if k != 'traceback'})}")
    return results


def _combine_rounds(rounds: List[Dict[str, Any]]) -> Dict[str, Any]:
    """``--rounds``: one row per method from its rows of every round.

    Numbers are medians over the rounds the method ran in (``steps_per_s`` is that of the
    median ``ms_per_step``). The ratios (to the ceiling, to
    SpeedTorch's rows) are medians of each round's own ratio, a method against the
    baseline of the same round, so a machine that speeds up or slows down between rounds
    moves both sides. Each row keeps ``rounds_ms_per_step`` and, where a ceiling ran,
    ``rounds_ratio_to_ceiling`` (in round order); a method that failed in every round
    keeps its first error.
    """
    names: List[str] = []
    for res in rounds:
        names += [n for n in res if n not in names]
    out: Dict[str, Any] = {}
    for name in names:
        rows = [res[name] for res in rounds if "steps_per_s" in res.get(name, {})]
        if not rows:
            out[name] = next(res[name] for res in rounds if name in res)
            continue
        row = dict(rows[0])
        for key, v in rows[0].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
                row[key] = statistics.median(vals)
        row["steps_per_s"] = 1e3 / row["ms_per_step"]  # consistent with the median time
        row["rounds"] = len(rows)
        row["rounds_ms_per_step"] = [r["ms_per_step"] for r in rows]
        for key, base in _baselines(name):
            ratios = [res[name]["steps_per_s"] / res[base]["steps_per_s"] for res in rounds
                      if "steps_per_s" in res.get(name, {}) and res.get(base, {}).get("steps_per_s")]
            if ratios:
                row[key] = statistics.median(ratios)
                row[f"rounds_{key}"] = ratios
        out[name] = row
    return out


class _Tracer:
    """torch.profiler (CPU + CUDA activity) and cProfile of the training thread."""

    def __init__(self, dev, ops=True):
        import cProfile

        self.prof = None
        if ops:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if dev.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
        self.cp = cProfile.Profile()
        self.cp.enable()

    def finish(self, out_dir):
        self.cp.disable()
        os.makedirs(out_dir, exist_ok=True)
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            ka = self.prof.key_averages()
            with open(os.path.join(out_dir, "trace_ops.txt"), "w") as f:
                for key in ("self_cpu_time_total", "cpu_time_total", "device_time_total"):
                    try:
                        f.write(f"== sorted by {key}\n" + ka.table(sort_by=key, row_limit=60) + "\n")
                    except Exception as exc:  # a key this torch does not know
                        f.write(f"== {key}: {exc}\n")
            try:
                self.prof.export_chrome_trace(os.path.join(out_dir, "trace.json"))
            except Exception:
                pass
        with open(os.path.join(out_dir, "trace_cprofile.txt"), "w") as f:
            f.write(_cprofile_tables(self.cp, limit=90))


# ------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--steps", type=int, default=200, help="timed steps per method")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="100k rows, 20 steps (runs on CPU too)")
    ap.add_argument("--out", default=None, help="directory for train_skipgram.json and .log")
    ap.add_argument("--methods", default="gpu_sparse_adam,naive_host,speedtorch_sgd,speedtorch_adam,"
                    "compat_sgd,compat_adam,stpipe_depth0,stpipe_depth1,profile")
    ap.add_argument("--backend", default=None, help="stpipe HostTable backend (default: auto)")
    ap.add_argument("--trace", default=None, help="method 'trace' writes torch.profiler / cProfile tables here")
    ap.add_argument("--isolate", action="store_true",
                    help="run each method in its own fresh process (same batches: same seed) "
                         "and report them together, so no row runs after another in one process")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --isolate: run every method this many times, the order reversed "
                         "in every other round; each row reports medians over its rounds and "
                         "the median of its per-round ratios (default 1)")
    ap.add_argument("--uva-blocks-per-sm", type=int, default=None,
                    help="experiment: cap the UVA row kernels' grid at this many blocks per "
                         "multiprocessor (default: stpipe's, 32)")
    ap.add_argument("--interleave", type=int, default=0, metavar="N",
                    help="run the methods (" + ", ".join(INTERLEAVE_METHODS) + ") in one process, "
                         "in turn, in blocks of N timed steps, until each timed --steps; ratios are "
                         "medians of per-block ratios (default 0: off)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ATTR:VALUE[,ATTR:VALUE]",
                    help="with --interleave: one more depth-1 row, stpipe_depth1[NAME], over the same "
                         "tables, its Pipeline with these attributes set (values are Python literals; "
                         "e.g. f4=_auto_fraction:0.4), reported with its paired difference to "
                         "stpipe_depth1 when that runs too; repeatable")
    ap.add_argument("--prefetch-delay-ms", type=float, default=0.5,
                    help="method stpipe_depth1_delay: Pipeline(prefetch_delay=) in ms (default 0.5)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds: expected >= 1, got {args.rounds}")
    if args.rounds > 1 and not args.isolate:
        ap.error("--rounds > 1 needs --isolate (each round's methods in fresh processes)")
    if args.interleave < 0:
        ap.error(f"--interleave: expected N >= 0, got {args.interleave}")
    if args.interleave and args.isolate:
        ap.error("--interleave runs every method in one process; it cannot be combined with --isolate")
    if args.variant and not args.interleave:
        ap.error("--variant needs --interleave (its row is timed in the same rounds as the others)")
    try:
        args.variant = [parse_variant(v) for v in args.variant]  # (name, attributes), parsed once
    except ValueError as exc:
        ap.error(f"--variant: {exc}")
    names = [name for name, _ in args.variant]
    if len(set(names)) != len(names):
        ap.error(f"--variant: each NAME once, got {', '.join(names)}")
    if args.quick:
        args.rows = min(args.rows, 100_000)
        args.steps = min(args.steps, 20)
        args.warmup = min(args.warmup, 3)
    if args.uva_blocks_per_sm is not None:
        if args.uva_blocks_per_sm < 1:
            raise SystemExit(f"--uva-blocks-per-sm: expected >= 1, got {args.uva_blocks_per_sm}")
        import stpipe.kernels._cupy as _kc

        _kc.BLOCKS_PER_SM = args.uva_blocks_per_sm
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    log = Log(os.path.join(args.out, "train_skipgram.log") if args.out else None)
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    info = {
        "rows": args.rows, "dim": DIM, "batch": BATCH, "pos": POS, "neg": NEG, "optimizer": "Adam lr 1e-3",
        "ids": "Zipf(1.2)", "steps": args.steps, "warmup": args.warmup, "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "torch": torch.__version__, "python": platform.python_version(),
        "table_gb_each": args.rows * DIM * 4 / 1e9, "uva_blocks_per_sm": args.uva_blocks_per_sm,
    }
    log("== skip-gram benchmark", json.dumps(info))
    t0 = time.perf_counter()
    batches = make_batches(args.rows, args.steps + args.warmup)
    uniq = [len(torch.unique(torch.cat([b["pos"].reshape(-1), b["neg"].reshape(-1)]))) for b in batches[:20]]
    info["unique_context_rows_per_step"] = float(np.mean(uniq))
    log(f"batches made in {time.perf_counter() - t0:.1f} s; unique context rows/step ~{np.mean(uniq):.0f}")
    results: Dict[str, Any] = {}
    st = None
    trace_dir = args.trace or os.path.join(args.out or ".", "trace")
    if args.isolate and args.rounds == 1:
        results = _run_isolated(args, methods, log)
    elif args.isolate:
        per_round = []
        for r, order in enumerate(_round_orders(methods, args.rounds)):
            log(f"== round {r + 1} of {args.rounds}: {','.join(order)}")
            per_round.append(_run_isolated(args, order, log))
        results = _combine_rounds(per_round)
        info["rounds"] = args.rounds
        log("")
        log("per round, ms/step (x ceiling of the same round):")
        for name, r in results.items():
            if "rounds_ms_per_step" in r:
                ratios = r.get("rounds_ratio_to_ceiling")
                log(f"  {name:<24}" + "  ".join(
                    f"{ms:.3f}" + (f" ({ratios[i]:.2f})" if ratios and i < len(ratios) else "")
                    for i, ms in enumerate(r["rounds_ms_per_step"])))
    if args.interleave:
        log(f"== interleaved blocks of {args.interleave} timed steps: {','.join(methods)}")
        results = run_interleaved(args, dev, batches, methods, log)
        info["interleave"] = args.interleave
        for name, r in results.items():
            if "blocks_ms_per_step" in r:
                log(f"  {name:<24}" + " ".join(f"{x:.3f}" for x in r["blocks_ms_per_step"]))
        for name, r in results.items():
            d = r.get("minus_stpipe_depth1")
            if d:
                se = "" if d["se_ms"] is None else f" +- {d['se_ms']:.3f}"
                log(f"  {name} minus stpipe_depth1: median {d['median_ms']:+.3f} ms/step, mean "
                    f"{d['mean_ms']:+.3f}{se}; faster in {d['blocks_faster']} of {d['blocks']} blocks")
    for m in ([] if args.isolate or args.interleave else methods):
        reset_gpu(dev)
        log(f"-- {m}")
        rkey = _RESULT_KEYS.get(m, m)
        try:
            if m == "gpu_sparse_adam":
                results[m] = run_ceiling(args, dev, batches)
            elif m == "naive_host":
                results[m] = run_naive(args, dev, batches)
            elif m in SPEEDTORCH_ROWS:
                results[m] = run_speedtorch(args, dev, batches, *_speedtorch_kind(m))
            elif m in ("compute_only", "compute_only_fused"):
                results[m] = run_compute_only(args, dev, batches, fused=m.endswith("fused"))
            elif m == "stpipe_depth1_switch":
                # GIL hand-over experiment: a 0.2 ms switch interval instead of 5 ms
                if st is None:
                    st = _Stpipe(args, dev)
                old_si = sys.getswitchinterval()
                sys.setswitchinterval(0.0002)
                try:
                    results[m] = st.run(args, dev, batches, 1)
                finally:
                    sys.setswitchinterval(old_si)
            elif m in ("stpipe_depth1_gate", "stpipe_depth1_nogate"):
                # depth 1 with the experimental prefetch gate on (the prefetch thread waits
                # for the step's first lookup before issuing) or explicitly off (default)
                if st is None:
                    st = _Stpipe(args, dev)
                with mock.patch.dict(os.environ, {"STPIPE_PREFETCH_GATE": "1" if m.endswith("_gate") else "0"}):
                    results[m] = st.run(args, dev, batches, 1)
            elif m in ("stpipe_depth1_delay", "stpipe_depth1_nodelay"):
                # depth 1, each batch issued --prefetch-delay-ms (or no time) after its slot frees
                if st is None:
                    st = _Stpipe(args, dev)
                results[m] = st.run(args, dev, batches, 1,
                                    prefetch_delay=args.prefetch_delay_ms / 1e3 if m.endswith("_delay") else 0.0)
            elif m == "stpipe_depth1_fused":
                st = None  # free the foreach-Adam tables first (host RAM)
                gc.collect()
                stf = _Stpipe(args, dev, fused=True)
                log(f"stpipe tables (fused Adam) ready in {stf.setup_s:.1f} s")
                results[m] = stf.run(args, dev, batches, 1)
                del stf
                gc.collect()
            elif m == "stpipe_depth1_ids_only":
                # depth 1 with run(..., to_device=False): the batch here is nothing but
                # ids, so its tensors need not travel ahead (less prefetch-thread work)
                if st is None:
                    st = _Stpipe(args, dev)
                results[m] = st.run(args, dev, batches, 1, to_device=False)
            elif m == "parts":
                if st is None:
                    st = _Stpipe(args, dev)
                results[rkey] = run_parts(args, dev, batches, st)
            elif m == "trace0":
                # depth 0 under cProfile alone: every stpipe call in the training thread
                if st is None:
                    st = _Stpipe(args, dev)
                results[m] = st.run(args, dev, batches, 0, trace_ops=False,
                                    trace=os.path.join(trace_dir, "depth0"))
            elif m == "trace_prefetch":
                # depth 1 with cProfile started in the prefetch thread
                if st is None:
                    st = _Stpipe(args, dev)
                results[m] = st.run(args, dev, batches, 1,
                                    trace_prefetch=os.path.join(trace_dir, "prefetch"))
            elif m in ("stpipe_depth0", "stpipe_depth1", "stpipe_depth2", "profile", "trace"):
                if st is None:
                    st = _Stpipe(args, dev)
                    log(f"stpipe tables ready in {st.setup_s:.1f} s")
                depth = {"stpipe_depth0": 0, "stpipe_depth2": 2}.get(m, 1)
                results[rkey] = st.run(args, dev, batches, depth, profile=(m == "profile"),
                                      trace=trace_dir if m == "trace" else None)
            else:
                results[m] = {"skipped": "unknown method"}
        except Exception as exc:  # keep going: report what failed
            results[m] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        log(f"   {json.dumps({k: v for k, v in results.get(rkey, {}).items() if k != 'traceback'})}")
        if m in ("gpu_sparse_adam", "naive_host") + SPEEDTORCH_ROWS:
            gc.collect()
    ceiling = results.get("gpu_sparse_adam", {}).get("steps_per_s")
    for r in results.values():
        if ceiling and "steps_per_s" in r:
            r.setdefault("ratio_to_ceiling", r["steps_per_s"] / ceiling)  # --rounds: set per round
    log("")
    log(f"{'method':<24}{'steps/s':>10}{'ms/step':>10}{'x ceiling':>11}{'GPU peak GB':>13}{'GPU used GB':>13}"
        f"{'host RSS GB':>13}{'train CPU ms':>14}{'prefetch CPU ms':>17}")
    for name, r in results.items():
        if "parts_us_per_step" in r:
            continue  # its own account, below
        if "steps_per_s" not in r:
            log(f"{name:<24}  {r.get('skipped') or r.get('error')}")
            continue
        log(f"{name:<24}{r['steps_per_s']:>10.1f}{r['ms_per_step']:>10.2f}{r.get('ratio_to_ceiling', float('nan')):>11.2f}"
            f"{r['gpu_peak_alloc_gb']:>13.2f}{r['gpu_used_gb']:>13.2f}{r['host_rss_gb']:>13.2f}"
            f"{r.get('train_cpu_ms_per_step', float('nan')):>14.2f}{r.get('prefetch_cpu_ms_per_step', float('nan')):>17.2f}")
    for base in SPEEDTORCH_BASES:
        b = results.get(base, {}).get("steps_per_s")
        if not b:
            continue
        for name, r in results.items():
            if (name.startswith(("stpipe", "compat")) and "steps_per_s" in r
                    and not name.endswith(("_profile", "_trace"))):
                r.setdefault(f"ratio_to_{base}", r["steps_per_s"] / b)
        log(f"x {base}: " + ", ".join(f"{n} {r[f'ratio_to_{base}']:.2f}" for n, r in results.items()
                                       if f"ratio_to_{base}" in r))
    parts = results.get(_RESULT_KEYS["parts"])
    if parts and "phases_us" in parts:
        ph = parts["phases_us"]
        log("stpipe depth 1 by phase (median us, wall; the step alone; the difference): "
            + ", ".join(f"{k} {v:.0f}/{ph['step_alone'].get(k, float('nan')):.0f}/"
                        f"{ph['depth1_minus_step_alone'].get(k, float('nan')):+.0f}" for k, v in ph["depth1"].items()))
        log(f"issue from {ph.get('issue_start_us', float('nan')):.0f} to {ph.get('issue_end_us', float('nan')):.0f} "
            "us after the start of the step during which it began; parts (us per step: CPU, wall, calls):")
        for k, v in parts["parts_us_per_step"].items():
            log(f"  {k:<32}{v['cpu']:>9.1f}{v['wall']:>9.1f}{v['calls']:>7.2f}")
    prof = results.get(_RESULT_KEYS["profile"], {}).get("profile_ms")
    if prof:
        log("stpipe depth 1 profile (median ms/step, synchronised phases): "
            + ", ".join(f"{k[:-3]} {v:.3f}" for k, v in prof.items()))
    if args.out:
        with open(os.path.join(args.out, "train_skipgram.json"), "w") as f:
            json.dump({"info": info, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

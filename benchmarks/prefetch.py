"""Benchmark: how much of a batch's host-to-device copy ``stpipe.prefetch`` hides.

A training loop whose batches are 64 MiB of pinned host tensors (a dict of float32
features and int64 ids) and whose compute (a read of the batch, then a matmul loop
calibrated to the measured copy time) takes about as long as their copy, run four ways:

* ``compute``: the batches already on the GPU (the floor);
* ``plain``: ``.to(device)`` in the loop (copy, then compute);
* ``one_stream``: a torchtnt-style prefetcher written here: the training thread copies
  batch N+1 on one side stream right after handing out batch N;
* ``stpipe``: :func:`stpipe.prefetch` (thread, copy stream, events).

Reported: step time, its ratio to ``compute``, and the fraction of the copy hidden,
``(plain - mode) / (plain - compute)``. Target on an H200: ``stpipe`` hides >= 90% and
stays within 5% of ``compute``.

Usage::

    python benchmarks/prefetch.py [--quick] [--steps N] [--out DIR]

Prints a table and writes ``DIR/prefetch.json``. Without CUDA it says so and runs a tiny
CPU version (no copies exist there: it only checks the harness and the thread's cost).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

try:
    from stpipe import prefetch
except ImportError:  # not exported from stpipe/__init__.py yet
    from stpipe.loader import prefetch

MiB = 1 << 20
Batch = Dict[str, torch.Tensor]


# ----------------------------------------------------------------------------- batches


def make_batches(count: int, batch_mib: int, pin: bool) -> List[Batch]:
    """Return ``count`` distinct host batches of ``batch_mib`` MiB: 3/4 float32, 1/4 int64."""
    x_elems = batch_mib * MiB * 3 // 4 // 4
    ids_elems = batch_mib * MiB // 4 // 8
    out = []
    for i in range(count):
        b = {
            "x": torch.full((x_elems // 1024, 1024), float(i + 1)),
            "ids": torch.full((ids_elems,), i, dtype=torch.int64),
        }
        out.append({k: v.pin_memory() for k, v in b.items()} if pin else b)
    return out


def batch_stream(batches: List[Batch], steps: int) -> Iterator[Batch]:
    """The loader: ``steps`` batches, cycling through ``batches``."""
    for i in range(steps):
        yield batches[i % len(batches)]


class OneStreamPrefetcher:
    """torchtnt-style prefetcher: copies batch N+1 on a side stream after handing out N.

    Stream contract: the copies run on ``self.stream`` (issued from the training thread,
    pinned sources, ``non_blocking=True``); at hand-out the current stream waits on the
    side stream and each tensor is ``record_stream``-ed on the current stream.
    """

    def __init__(self, loader: Iterator[Batch], device: torch.device) -> None:
        self.it = iter(loader)
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.next: Optional[Batch] = None
        self._preload()

    def _preload(self) -> None:
        try:
            batch = next(self.it)
        except StopIteration:
            self.next = None
            return
        with torch.cuda.stream(self.stream):
            self.next = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def __iter__(self) -> "OneStreamPrefetcher":
        return self

    def __next__(self) -> Batch:
        if self.next is None:
            raise StopIteration
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        batch = self.next
        for t in batch.values():
            t.record_stream(current)
        self._preload()
        return batch


# ----------------------------------------------------------------------------- compute


class Compute:
    """One training step's stand-in: read the whole batch, then ``n`` matmuls."""

    def __init__(self, device: torch.device, dim: int, dtype: torch.dtype, n: int) -> None:
        g = torch.Generator(device="cpu").manual_seed(0)
        self.a = (torch.randn(dim, dim, generator=g) / dim**0.5).to(device, dtype)
        self.w = (torch.randn(dim, dim, generator=g) / dim**0.5).to(device, dtype)
        self.c = torch.empty(dim, dim, device=device, dtype=dtype)
        self.acc = torch.zeros((), device=device, dtype=torch.float64)
        self.n = n

    def matmuls(self, n: int) -> None:
        for _ in range(n):
            torch.mm(self.a, self.w, out=self.c)

    def __call__(self, batch: Batch) -> None:
        self.acc += batch["x"].sum(dtype=torch.float64) + batch["ids"].sum()
        self.matmuls(self.n)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_loop(run: Callable[[], None], device: torch.device, steps: int) -> float:
    """Run ``run`` (a whole loop of ``steps`` steps) and return ms per step (synced)."""
    _sync(device)
    t0 = time.perf_counter()
    run()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / steps


def cuda_ms(fn: Callable[[], None], reps: int, stream: Optional[torch.cuda.Stream] = None) -> float:
    """Median ms of ``fn`` over ``reps`` runs, timed with CUDA events on ``stream``."""
    stream = stream or torch.cuda.current_stream()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            fn()
            end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# ----------------------------------------------------------------------------- runs


def run_cuda(args: argparse.Namespace) -> Dict[str, Any]:
    """The real benchmark on the current CUDA device."""
    device = torch.device("cuda", torch.cuda.current_device())
    host = make_batches(4, args.batch_mib, pin=True)
    resident = [{k: v.to(device) for k, v in b.items()} for b in host]
    nbytes = sum(t.numel() * t.element_size() for t in host[0].values())

    side = torch.cuda.Stream(device)

    def one_copy() -> None:
        for t in host[1].values():
            t.to(device, non_blocking=True)

    for _ in range(5):
        one_copy()
    copy_ms = cuda_ms(one_copy, 30, side)

    probe = Compute(device, args.dim, torch.bfloat16, 0)
    probe.matmuls(200)  # warm clocks and cuBLAS
    mm_ms = cuda_ms(lambda: probe.matmuls(50), 5) / 50
    read_ms = cuda_ms(lambda: probe(resident[0]), 10)
    n = max(1, round((copy_ms - read_ms) / mm_ms))
    compute = Compute(device, args.dim, torch.bfloat16, n)
    step_compute_ms = cuda_ms(lambda: compute(resident[0]), 10)

    steps, warm = args.steps, max(5, args.steps // 10)

    def loop_compute(k: int) -> Callable[[], None]:
        def run() -> None:
            for i in range(k):
                compute(resident[i % len(resident)])
        return run

    def loop_plain(k: int) -> Callable[[], None]:
        def run() -> None:
            for b in batch_stream(host, k):
                compute({key: v.to(device) for key, v in b.items()})
        return run

    def loop_one_stream(k: int) -> Callable[[], None]:
        def run() -> None:
            for b in OneStreamPrefetcher(batch_stream(host, k), device):
                compute(b)
        return run

    def loop_stpipe(k: int) -> Callable[[], None]:
        def run() -> None:
            for b in prefetch(batch_stream(host, k), device, depth=args.depth):
                compute(b)
        return run

    modes = {
        "compute": loop_compute,
        "plain": loop_plain,
        "one_stream": loop_one_stream,
        "stpipe": loop_stpipe,
    }
    results: Dict[str, List[float]] = {m: [] for m in modes}
    for _ in range(args.reps):  # interleave modes so drift hits all alike
        for name, make in modes.items():
            timed_loop(make(warm), device, warm)
            results[name].append(timed_loop(make(steps), device, steps))
    _sync(device)

    step = {m: statistics.median(v) for m, v in results.items()}
    span = step["plain"] - step["compute"]
    hidden = {m: ((step["plain"] - step[m]) / span if span > 0 else None) for m in ("one_stream", "stpipe")}
    return {
        "device": torch.cuda.get_device_name(device),
        "batch_mib": nbytes / MiB,
        "copy_ms": copy_ms,
        "copy_gbps": nbytes / copy_ms / 1e6,
        "matmul_dim": args.dim,
        "matmul_ms": mm_ms,
        "matmuls_per_step": n,
        "compute_step_ms_events": step_compute_ms,
        "steps": steps,
        "reps": args.reps,
        "depth": args.depth,
        "step_ms": step,
        "step_ms_all": results,
        "hidden_fraction": hidden,
        "vs_compute": {m: step[m] / step["compute"] for m in step},
        "targets": {
            "hidden_ge_0.90": hidden["stpipe"] is not None and hidden["stpipe"] >= 0.90,
            "within_5pct_of_compute": step["stpipe"] <= 1.05 * step["compute"],
        },
    }


def run_cpu(args: argparse.Namespace) -> Dict[str, Any]:
    """The tiny CPU version: no copies exist, so only the harness and thread cost."""
    device = torch.device("cpu")
    host = make_batches(4, 1, pin=False)
    compute = Compute(device, 128, torch.float32, 8)
    steps = min(args.steps, 50)

    def loop_compute() -> None:
        for i in range(steps):
            compute(host[i % len(host)])

    def loop_plain() -> None:
        for b in batch_stream(host, steps):
            compute({k: v.to(device) for k, v in b.items()})

    def loop_stpipe() -> None:
        for b in prefetch(batch_stream(host, steps), device, depth=args.depth):
            compute(b)

    modes = {"compute": loop_compute, "plain": loop_plain, "stpipe": loop_stpipe}
    results: Dict[str, List[float]] = {m: [] for m in modes}
    for run in modes.values():  # warm up
        run()
    for _ in range(args.reps):
        for name, run in modes.items():
            results[name].append(timed_loop(run, device, steps))
    step = {m: statistics.median(v) for m, v in results.items()}
    return {
        "device": "cpu",
        "note": "no CUDA: tiny CPU run, no copies to hide (hidden fraction undefined)",
        "batch_mib": 1,
        "steps": steps,
        "reps": args.reps,
        "depth": args.depth,
        "step_ms": step,
        "step_ms_all": results,
        "hidden_fraction": {"stpipe": None},
        "vs_compute": {m: step[m] / step["compute"] for m in step},
    }


def print_table(res: Dict[str, Any]) -> None:
    """Print one row per mode: step ms, ratio to compute, copy hidden."""
    print(f"\n{res['device']}: batch {res['batch_mib']:.0f} MiB, {res['steps']} steps x {res['reps']} reps, depth {res['depth']}")
    if "copy_ms" in res:
        print(
            f"copy {res['copy_ms']:.3f} ms ({res['copy_gbps']:.1f} GB/s); compute = batch read + "
            f"{res['matmuls_per_step']} x bf16 {res['matmul_dim']}^2 matmul "
            f"({res['compute_step_ms_events']:.3f} ms by events)"
        )
    print(f"{'mode':<12}{'step ms':>10}{'vs compute':>12}{'copy hidden':>13}")
    for mode, ms in res["step_ms"].items():
        hid = res["hidden_fraction"].get(mode)
        hid_s = f"{hid * 100:.1f}%" if hid is not None else "-"
        print(f"{mode:<12}{ms:>10.3f}{res['vs_compute'][mode]:>11.3f}x{hid_s:>13}")
    if "targets" in res:
        print("targets (stpipe):", ", ".join(f"{k}={v}" for k, v in res["targets"].items()))


def main(argv: Optional[List[str]] = None) -> int:
    """Parse arguments, run, print the table, write ``--out/prefetch.json``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run (default 200, quick 40)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per mode (default 5, quick 2)")
    ap.add_argument("--depth", type=int, default=2, help="stpipe.prefetch depth")
    ap.add_argument("--batch-mib", type=int, default=64, help="batch size in MiB")
    ap.add_argument("--dim", type=int, default=2048, help="matmul size of the compute loop")
    ap.add_argument("--out", default=None, help="directory for prefetch.json")
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 40 if args.quick else 200
    if args.reps is None:
        args.reps = 2 if args.quick else 5
    if args.steps < 1 or args.reps < 1:
        ap.error("--steps and --reps must be >= 1")

    if torch.cuda.is_available():
        res = run_cuda(args)
    else:
        print("note: CUDA is not available; running a tiny CPU version (no copies to hide)")
        res = run_cpu(args)
    res.update(
        torch=torch.__version__, python=platform.python_version(), host=platform.node(),
        argv=sys.argv[1:], quick=args.quick,
    )
    print_table(res)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "prefetch.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=2)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

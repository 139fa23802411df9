"""Planner benchmark: the Cython planner vs its numpy twin, ``np.unique`` and ``torch.unique``.

One run prints, on the same inputs, the median time of each and the ratios to
``np.unique(return_inverse=True)``: batches of 131,072 ids drawn uniform and Zipf(1.2)
over 10,000,000 rows, plus a size sweep 1K..1M ids (uniform and Zipf). Validation is
part of the measured time of the stpipe planners (``stpipe.planner.plan``).

    python benchmarks/planner.py [--repeats 15] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

from stpipe import planner


def _zipf(rng: np.random.Generator, n: int, rows: int, a: float = 1.2) -> np.ndarray:
    out = np.empty(0, dtype=np.int64)
    while out.size < n:
        z = rng.zipf(a, 2 * n)
        out = np.concatenate([out, z[z <= rows] - 1])
    return out[:n].astype(np.int64)


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _each_impl():
    """Each planner implementation that loads, with ``STPIPE_PLANNER`` set to it while
    the caller times it (unset afterwards)."""
    try:
        for impl in ("cython", "numpy"):
            if impl == "cython" and planner._compiled is None:
                continue
            os.environ["STPIPE_PLANNER"] = impl
            yield impl
    finally:
        os.environ.pop("STPIPE_PLANNER", None)


def _run(ids: np.ndarray, rows: int, repeats: int) -> dict:
    res = {}
    for impl in _each_impl():
        res[f"stpipe-{impl}"] = _median_ms(lambda: planner.plan(ids, rows), repeats)
    res["np.unique"] = _median_ms(lambda: np.unique(ids, return_inverse=True), repeats)
    t = torch.from_numpy(ids)
    res["torch.unique(cpu)"] = _median_ms(lambda: torch.unique(t, sorted=True, return_inverse=True), repeats)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--batch", type=int, default=131_072)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--no-sweep", action="store_true", help="skip the 1K..1M size sweep")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    cases = [
        (f"uniform {args.batch}", rng.integers(0, args.rows, args.batch)),
        (f"zipf1.2 {args.batch}", _zipf(rng, args.batch, args.rows)),
    ]
    if not args.no_sweep:
        for n in (1_000, 10_000, 100_000, 1_000_000):
            cases.append((f"uniform {n}", rng.integers(0, args.rows, n)))
            cases.append((f"zipf1.2 {n}", _zipf(rng, n, args.rows)))
    print(f"planner benchmark: rows={args.rows:,}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"numpy {np.__version__}, median of {args.repeats}")
    hdr = f"{'case':<18}{'unique':>8}{'cython ms':>11}{'numpy-twin':>11}{'np.unique':>11}{'torch.uniq':>11}{'np/cython':>10}{'torch/cython':>13}"
    print(hdr)
    print("-" * len(hdr))
    out = []
    for name, ids in cases:
        r = _run(ids, args.rows, args.repeats)
        cy = r.get("stpipe-cython", float("nan"))
        k = int(np.unique(ids).size)
        print(f"{name:<18}{k:>8}{cy:>11.3f}{r['stpipe-numpy']:>11.3f}{r['np.unique']:>11.3f}"
              f"{r['torch.unique(cpu)']:>11.3f}{r['np.unique'] / cy:>9.1f}x{r['torch.unique(cpu)'] / cy:>12.1f}x")
        out.append({"case": name, "n": int(ids.size), "unique": k, **r})
    extra = _side_calls(rng, args.rows, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": args.rows, "python": sys.version, "results": out, "side": extra}, f, indent=2)
    return 0


def _side_calls(rng: np.random.Generator, rows: int, repeats: int) -> dict:
    """The planner's other per-batch calls: ``overlap`` of two consecutive skip-gram
    context batches (512 x (4 + 64) Zipf ids, as the pipeline computes it for each batch
    in flight), and the id check of a host-table call on sorted unique ids
    (``scan_ids``, against ``check_ids`` plus a sortedness pass)."""
    a = planner.plan(_zipf(rng, 512 * 68, rows), rows)
    b = planner.plan(_zipf(rng, 512 * 68, rows), rows)
    sorted_ids = np.unique(rng.integers(0, rows, 131_072))
    res = {}
    for impl in _each_impl():
        res[f"overlap {impl}"] = _median_ms(lambda: planner.overlap(a, b), repeats)
        res[f"scan_ids {impl}"] = _median_ms(lambda: planner.scan_ids(sorted_ids, rows), repeats)
        res[f"check_ids + sorted pass {impl}"] = _median_ms(
            lambda: (planner.check_ids(sorted_ids, rows), bool(np.all(sorted_ids[1:] >= sorted_ids[:-1]))),
            repeats)
    res["np.intersect1d"] = _median_ms(
        lambda: np.intersect1d(a.unique, b.unique, assume_unique=True, return_indices=True), repeats)
    shared = len(planner.overlap(a, b)[0])
    print(f"\noverlap of two {a.num_ids:,}-id Zipf batches ({a.num_unique:,} and {b.num_unique:,} unique, "
          f"{shared:,} shared); id checks of {sorted_ids.size:,} sorted unique ids; median ms:")
    for name, ms in res.items():
        print(f"  {name:<32}{ms:>9.4f}")
    return res


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: saving and loading a checkpoint of a big table with Adam state.

One ``(rows, dim)`` float32 table plus Adam's ``exp_avg`` and ``exp_avg_sq`` (three tables,
``3 * rows * dim * 4`` bytes; 15.4 GB at the default 10M x 128), saved and loaded five ways,
each in its own child process so that its peak RSS (``VmHWM``) is its own:

* ``stpipe.save``: :func:`stpipe.checkpoint.save` of a pipeline (streamed ``.npy`` files,
  CRC-32 on the way, fsync, atomic rename);
* ``stpipe.load(first)``: :func:`stpipe.checkpoint.load` into fresh objects, checksums
  verified in a first pass, then streamed into the tables (the default);
* ``stpipe.load(stream)``: one pass, checksums checked while reading;
* ``torch.save``: ``torch.save`` of a dict of the same three tensors, then fsync;
* ``torch.load``: ``torch.load(..., weights_only=True)`` of that file.

Reported per method: seconds, GB/s, peak RSS, the RSS of the interpreter and imports
before any table exists, and the RSS *overhead*: peak minus imports minus the tables' own
bytes (what the method needs beyond holding the tables: a second copy shows up here). ``stpipe / torch`` ratios follow. Files are written under ``--dir`` (default a
temporary directory next to ``--out``), which is deleted at the end. Loads read files the
save just wrote, so they mostly come from the page cache (dropping it needs root): read
them as memory-to-memory figures.

Usage::

    python benchmarks/checkpoint.py [--rows N] [--dim D] [--quick] [--out DIR] [--dir DIR]

Prints a table and writes ``DIR/checkpoint.json`` when ``--out`` is given.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

GB = 1e9
METHODS = ["stpipe.save", "stpipe.load(first)", "stpipe.load(stream)", "torch.save", "torch.load"]


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


# ------------------------------------------------------------------------- children
def _pipeline(rows: int, dim: int, init: str):
    import torch

    from stpipe.embedding import HostEmbedding
    from stpipe.pipeline import Pipeline

    emb = HostEmbedding(rows, dim, init=init, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.Adam(emb.parameters(), lr=1e-3)
    return emb, opt, Pipeline(emb, optimizer=opt, ids="ids", depth=0)


def child(method: str, rows: int, dim: int, work: str) -> Dict[str, Any]:
    import torch

    import stpipe.checkpoint as ckpt
    import stpipe.pipeline  # noqa: F401 - every child imports the same before measuring

    torch.manual_seed(0)
    # building an optimizer imports torch._dynamo & co (~160 MB RSS): every child does it
    # before measuring, as a training process would have
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
    base = _status_kb("VmRSS")  # interpreter + imports, no tables yet
    nbytes = 3 * rows * dim * 4
    ck = os.path.join(work, "stpipe-ck")
    pt = os.path.join(work, "tables.pt")
    if method == "stpipe.save":
        emb, opt, pipe = _pipeline(rows, dim, "uniform")
        with pipe:  # one step: Adam's state tables exist (every row), then fill them
            for step in pipe.run([{"ids": torch.arange(8)}]):
                with step:
                    emb(step.ids).sum().backward()
                    opt.step()
                    opt.zero_grad()
            for t in emb.state_tables.values():
                t.uniform_(0.0, 1e-3)
            before = _status_kb("VmRSS")
            t0 = time.perf_counter()
            ckpt.save(ck, pipe, extra={"step": 1})
            dt = time.perf_counter() - t0
    elif method.startswith("stpipe.load"):
        emb, opt, pipe = _pipeline(rows, dim, "none")
        before = _status_kb("VmRSS")
        t0 = time.perf_counter()
        ckpt.load(ck, pipe, verify="first" if "first" in method else "stream")
        dt = time.perf_counter() - t0
        assert sorted(emb.state_tables) == ["exp_avg", "exp_avg_sq"]
    elif method == "torch.save":
        tensors = {k: torch.empty(rows, dim) for k in ("weight", "exp_avg", "exp_avg_sq")}
        for v in tensors.values():
            v.uniform_(-0.1, 0.1)
        before = _status_kb("VmRSS")
        t0 = time.perf_counter()
        torch.save(tensors, pt)
        with open(pt, "rb+") as f:
            os.fsync(f.fileno())
        dt = time.perf_counter() - t0
    elif method == "torch.load":
        before = _status_kb("VmRSS")
        t0 = time.perf_counter()
        tensors = torch.load(pt, weights_only=True)
        dt = time.perf_counter() - t0
        assert tensors["weight"].shape == (rows, dim)
    else:
        raise SystemExit(f"unknown method {method}")
    peak = _status_kb("VmHWM")
    return {
        "method": method,
        "seconds": dt,
        "GB_per_s": nbytes / GB / dt,
        "base_rss_GB": base / GB,
        "rss_before_GB": before / GB,
        "peak_rss_GB": peak / GB,
        # what the method needs beyond the interpreter and the tables themselves
        "overhead_GB": (peak - base - nbytes) / GB,
    }


# --------------------------------------------------------------------------- parent
def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="200,000 rows (a few seconds)")
    ap.add_argument("--out", default=None, help="write checkpoint.json here")
    ap.add_argument("--dir", default=None, help="where the checkpoint files go (deleted at the end)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    rows = 200_000 if args.quick else args.rows
    if args.child:
        print(json.dumps(child(args.child, rows, args.dim, args.work)), flush=True)
        return 0

    nbytes = 3 * rows * args.dim * 4
    base = args.dir or (args.out if args.out else None)
    if base:
        os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="stpipe-ckbench-", dir=base)
    results = []
    try:
        for m in METHODS:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", m, "--work", work,
                   "--rows", str(rows), "--dim", str(args.dim)]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                print(p.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{m} failed (exit {p.returncode})")
            results.append(json.loads(p.stdout.strip().splitlines()[-1]))
            print(f"  {m}: {results[-1]['seconds']:.2f} s", file=sys.stderr, flush=True)
        size_ck = sum(os.path.getsize(os.path.join(work, "stpipe-ck", f)) for f in os.listdir(os.path.join(work, "stpipe-ck")))
        size_pt = os.path.getsize(os.path.join(work, "tables.pt"))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    by = {r["method"]: r for r in results}
    print(f"\ncheckpoint of {rows:,} x {args.dim} float32 + Adam state: 3 tables, {nbytes / GB:.2f} GB "
          f"(files: stpipe {size_ck / GB:.2f} GB, torch {size_pt / GB:.2f} GB)")
    print(f"{'method':<22}{'s':>8}{'GB/s':>8}{'peak RSS GB':>13}{'imports GB':>12}{'overhead GB':>13}")
    for r in results:
        print(f"{r['method']:<22}{r['seconds']:>8.2f}{r['GB_per_s']:>8.2f}{r['peak_rss_GB']:>13.2f}"
              f"{r['base_rss_GB']:>12.2f}{r['overhead_GB']:>13.3f}")
    ratios = {}
    for ours, theirs in (("stpipe.save", "torch.save"), ("stpipe.load(first)", "torch.load"),
                         ("stpipe.load(stream)", "torch.load")):
        a, b = by[ours], by[theirs]
        ratios[f"{ours} / {theirs}"] = {
            "time": a["seconds"] / b["seconds"],
            "peak_rss": a["peak_rss_GB"] / b["peak_rss_GB"],
            "peak_rss_less_imports": (a["peak_rss_GB"] - a["base_rss_GB"]) / (b["peak_rss_GB"] - b["base_rss_GB"]),
        }
    print("\nratios (stpipe / torch; < 1 means stpipe is faster / smaller)")
    for k, v in ratios.items():
        print(f"  {k:<34} time {v['time']:.2f}x   peak RSS {v['peak_rss']:.2f}x "
              f"(less imports {v['peak_rss_less_imports']:.2f}x)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        out = {"rows": rows, "dim": args.dim, "bytes": nbytes, "results": results, "ratios": ratios,
               "files_bytes": {"stpipe": size_ck, "torch": size_pt},
               "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
        with open(os.path.join(args.out, "checkpoint.json"), "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Row transfer benchmark: host table <-> GPU, every path side by side.

One run prints, for uniform random ids (deduplicated and sorted with ``np.unique``, as
the planner gives them) and Zipf(1.2) ids (deduplicated), the gather (host -> GPU) and
scatter (GPU -> host) bandwidth of:

* ``limit``: a contiguous pinned copy of the same bytes (the PCIe limit);
* ``naive``: ``table[ids].to('cuda')`` / ``table[ids] = x.cpu()``;
* ``index_select``: ``index_select`` into pinned staging + one copy / the reverse with
  ``index_copy_`` (the best plain PyTorch);
* ``speedtorch``: SpeedTorch 0.1.6 ``DataGadget(CPUPinn=True)`` when it imports (given
  numpy ids, as SpeedTorch code passes them);
* ``stpipe-compat``: the same ``DataGadget`` calls through ``stpipe.compat.speedtorch``;
* ``stpipe-<backend>``: ``HostTable.gather``/``scatter`` with each backend that loads.

It also reports host RSS growth against the table's bytes and the GPU memory the table
holds outside a step (should be 0). Times are CUDA-event medians of ``--repeats`` runs
after ``--warmup`` runs. Results go to ``--out``: ``transfer.json``, ``transfer.log``
and, when matplotlib imports, ``transfer.png`` (GB/s against batch size, ``--sweep``).

Examples::

    python benchmarks/transfer.py --out bench/            # 10M x 128 float32, batch 131072
    python benchmarks/transfer.py --rows 10000000 2000000 --sweep --out bench/
    python benchmarks/transfer.py --quick --out /tmp/b    # tiny; also runs without a GPU
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from typing import Dict, List, Optional

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stpipe.host import HostTable  # noqa: E402
from stpipe._bench import _backends, _gadgets, _paths, _plot_gbps, _timer  # noqa: E402
from stpipe.kernels import get_backend  # noqa: E402

GB = 1e9


class Log:
    """Print and keep every line for ``transfer.log``."""

    def __init__(self) -> None:
        self.lines: List[str] = []

    def __call__(self, *parts: object) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.lines.append(line)


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - not Linux
        return 0


def make_ids(kind: str, rows: int, batch: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        raw = rng.integers(0, rows, batch)
    elif kind == "zipf":
        raw = (rng.zipf(1.2, batch) - 1) % rows
    else:
        raise ValueError(kind)
    return np.unique(raw).astype(np.int64)


def run_point(table: HostTable, ids: np.ndarray, args, cuda: bool, backends, wrappers,
              gadgets, log: Log, label: str, fields: dict, quiet: bool = False) -> List[dict]:
    k = len(ids)
    nbytes = k * table.dim * table.itemsize
    usable = {name: wrappers[name] for name, why in backends.items() if not why}
    paths = _paths(table, usable, ids, cuda, gadgets)
    results = []
    if not quiet:
        log(f"\n[{label}] {k} unique rows x {table.dim} {str(table.dtype)[6:]} = "
            f"{nbytes / 2**20:.1f} MiB per batch")
        log(f"{'path':<21}{'gather GB/s':>12}{'x limit':>9}{'ms':>9}"
            f"{'scatter GB/s':>14}{'x limit':>9}{'ms':>9}")
    per_path: Dict[str, Dict[str, float]] = {}
    for op in ("gather", "scatter"):
        for name, fn in paths[op].items():
            reps = args.repeats if name != "naive" else max(3, args.repeats // 3)
            try:
                sec = _timer(fn, reps, args.warmup, cuda)
            except Exception as exc:  # a path that fails is reported, not fatal
                log(f"  {op} {name} failed: {type(exc).__name__}: {exc}")
                continue
            per_path.setdefault(name, {})[op] = sec
    limit = per_path.get("limit", {})
    for name, ops in per_path.items():
        row = {"label": label, "path": name, "unique_rows": k, "bytes": nbytes, **fields}
        cells = []
        for op in ("gather", "scatter"):
            sec = ops.get(op)
            if sec is None:
                cells += ["-", "-", "-"]
                continue
            gbps = nbytes / sec / GB
            ratio = (limit[op] / sec) if op in limit else float("nan")
            row[f"{op}_ms"], row[f"{op}_gbps"], row[f"{op}_x_limit"] = sec * 1e3, gbps, ratio
            cells += [f"{gbps:.2f}", f"{ratio:.2f}", f"{sec * 1e3:.3f}"]
        results.append(row)
        if not quiet:
            log(f"{name:<21}{cells[0]:>12}{cells[1]:>9}{cells[2]:>9}"
                f"{cells[3]:>14}{cells[4]:>9}{cells[5]:>9}")
    return results


def bench_table(rows: int, dim: int, dtype: torch.dtype, args, cuda: bool, log: Log,
                id_kinds=("uniform", "zipf"), batches: Optional[List[int]] = None,
                quiet: bool = False, speedtorch: bool = True) -> dict:
    """Build one table, measure memory, run every path for each id kind."""
    batches = batches or [args.batch]
    gc.collect()
    rss0 = rss_bytes()
    gpu0 = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    table = HostTable(rows, dim, dtype, backend="torch",
                      device="cuda" if cuda else "cpu", pin=cuda)
    t_create = time.perf_counter() - t0
    if not quiet:
        table.uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(0))
    elif not table.pinned:  # sweeps time copies only; page-locking already faulted pages in
        table.zeros_()
    t_init = time.perf_counter() - t0 - t_create
    rss_growth = rss_bytes() - rss0
    gpu_table = (torch.cuda.memory_allocated() - gpu0) if cuda else 0
    info = {
        "rows": rows, "dim": dim, "dtype": str(dtype), "table_bytes": table.nbytes,
        "pinned": table.pinned, "create_s": t_create, "init_s": t_init,
        "rss_growth_bytes": rss_growth, "rss_growth_x_table": rss_growth / table.nbytes,
        "gpu_bytes_outside_step": gpu_table,
    }
    if not quiet:
        log(f"\n=== table {rows} x {dim} {str(dtype)[6:]}: {table.nbytes / GB:.2f} GB, "
            f"pinned={table.pinned}, created in {t_create:.2f} s, initialised in {t_init:.2f} s")
        log(f"host RSS growth {rss_growth / GB:.2f} GB = {info['rss_growth_x_table']:.3f} x "
            f"table bytes (target <= 1.05); GPU memory held by the table: {gpu_table} bytes")
    backends = _backends(cuda, args.backends)
    for name, why in backends.items():
        if why and not quiet:
            log(f"note: stpipe backend {name} skipped: {why}")
    wrappers = {
        name: HostTable.from_tensor(table.tensor(), copy=False, backend=name,
                                    device="cuda" if cuda else "cpu", pin=cuda)
        for name, why in backends.items() if not why
    }
    gadgets = (_gadgets(table, args.out, log, speedtorch=cuda)
               if (speedtorch and not quiet) else {})
    results = []
    for kind in id_kinds:
        for batch in batches:
            ids = make_ids(kind, rows, batch)
            label = f"{kind} ids, batch {batch}, table {rows}x{dim} {str(dtype)[6:]}"
            fields = {"ids": kind, "batch": batch, "rows": rows, "dim": dim, "dtype": str(dtype)}
            results += run_point(table, ids, args, cuda, backends, wrappers, gadgets, log,
                                 label, fields, quiet=quiet)
    if cuda and "auto" in wrappers:
        auto = get_backend("auto")
        info["auto_decisions"] = {
            str(k): {"chosen": v[0], "candidate_ms": {n: t * 1e3 for n, t in v[1].items()}}
            for k, v in auto.decisions.items()
        }
        if not quiet:
            log("auto backend decisions (op, device, log2 table bytes, log2 batch bytes, "
                "sorted, pinned) -> choice [candidate ms]:")
            for k, v in auto.decisions.items():
                cands = ", ".join(f"{n} {t * 1e3:.2f}" for n, t in v[1].items())
                log(f"  {k} -> {v[0]}  [{cands}]")
    for w in wrappers.values():
        w.close()
    del gadgets
    table.close()
    gc.collect()
    return {"table": info, "results": results}


def plot(sweep: List[dict], path: str, log: Log) -> None:
    try:
        _plot_gbps(sweep, path, "uniform ids")
    except ImportError as exc:
        log(f"note: no PNG ({type(exc).__name__}: {exc})")
        return
    log(f"wrote {path}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_out", help="folder for JSON/PNG/log")
    p.add_argument("--rows", type=int, nargs="+", default=None,
                   help="table rows; several values run several tables (default 10000000)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--batch", type=int, default=None, help="ids drawn per batch (default 131072)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--backends", nargs="+", default=None,
                   help="stpipe backends (default: torch cupy numba auto)")
    p.add_argument("--sweep", action="store_true",
                   help="also sweep batch 4K..1M, dim 16..1024 and float16")
    p.add_argument("--quick", action="store_true", help="tiny table, few repeats (CPU-friendly)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.quick:
        args.rows = args.rows or [100_000]
        args.batch = args.batch or 8192
        args.repeats = args.repeats or 5
        args.warmup = min(args.warmup, 2)
    args.rows = args.rows or [10_000_000]
    args.batch = args.batch or 131_072
    args.repeats = args.repeats or 10
    os.makedirs(args.out, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    log = Log()
    env = {
        "python": platform.python_version(), "torch": torch.__version__,
        "numpy": np.__version__, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    log(f"stpipe transfer benchmark: {json.dumps(env)}")
    if not cuda:
        log("note: no CUDA: CPU-only run (stpipe torch backend vs naive indexing)")
    report = {"env": env, "args": vars(args), "tables": [], "sweep": []}
    for rows in args.rows:
        report["tables"].append(bench_table(rows, args.dim, dtype, args, cuda, log))
    if args.sweep:
        base_rows = args.rows[0]
        base_bytes = base_rows * args.dim * torch.empty((), dtype=dtype).element_size()
        log("\n=== sweep: batch size (uniform ids)")
        batches = [4096, 16384, 65536, 131072, 262144, 1048576]
        if args.quick:
            batches = [b for b in batches if b <= base_rows]
        r = bench_table(base_rows, args.dim, dtype, args, cuda, log, id_kinds=("uniform",),
                        batches=batches, quiet=True, speedtorch=False)
        for row in r["results"]:
            row["sweep"] = "batch"
        report["sweep"] += r["results"]
        for b in batches:
            _print_sweep_row(log, f"batch {b}", [x for x in r["results"] if x["batch"] == b])
        log("\n=== sweep: dim at equal table bytes (uniform ids, batch %d)" % args.batch)
        for dim in [16, 64, 128, 256, 1024]:
            rows = max(args.batch, base_bytes // (dim * 4))
            r = bench_table(rows, dim, torch.float32, args, cuda, log, id_kinds=("uniform",),
                            quiet=True, speedtorch=False)
            for row in r["results"]:
                row["sweep"] = "dim"
            report["sweep"] += r["results"]
            _print_sweep_row(log, f"dim {dim} ({rows} rows)", r["results"])
        log("\n=== sweep: float16")
        r = bench_table(base_rows, args.dim, torch.float16, args, cuda, log,
                        id_kinds=("uniform", "zipf"), quiet=True, speedtorch=False)
        for row in r["results"]:
            row["sweep"] = "float16"
        report["sweep"] += r["results"]
        _print_sweep_row(log, "float16", r["results"])
        plot([r for r in report["sweep"] if r.get("sweep") == "batch"],
             os.path.join(args.out, "transfer.png"), log)
    with open(os.path.join(args.out, "transfer.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    log(f"\nwrote {os.path.join(args.out, 'transfer.json')}")
    with open(os.path.join(args.out, "transfer.log"), "w") as f:
        f.write("\n".join(log.lines) + "\n")
    return 0


def _print_sweep_row(log: Log, what: str, results: List[dict]) -> None:
    parts = []
    for r in results:
        g, s = r.get("gather_gbps"), r.get("scatter_gbps")
        parts.append(f"{r['path']}={g:.1f}/{s:.1f}" if g and s else f"{r['path']}=?")
    log(f"{what:<26} gather/scatter GB/s: " + "  ".join(parts))


if __name__ == "__main__":
    sys.exit(main())

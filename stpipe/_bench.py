"""``python -m stpipe bench``: the transfer benchmark's headline comparison (private).

A compact, installable twin of ``benchmarks/transfer.py`` (which lives outside the
package): the same path names and definitions, uniform random ids deduplicated and sorted
as the planner gives them, medians of timed repeats after warm-up:

* ``limit``: a contiguous copy of the same bytes (pinned host -> GPU on CUDA; a host memcpy
  on a CPU-only machine);
* ``naive``: ``table[ids].to(device)`` / ``table[ids] = rows.cpu()``;
* ``index_select`` (CUDA only): ``index_select`` into pinned staging + one copy / the reverse
  with ``index_copy_``;
* ``speedtorch`` (CUDA, when SpeedTorch imports): ``DataGadget(CPUPinn=True)``;
* ``stpipe-compat`` (CUDA): the same ``DataGadget`` calls through
  ``stpipe.compat.speedtorch``;
* ``stpipe-<backend>``: :meth:`HostTable.gather` / :meth:`HostTable.scatter` with each
  backend that loads (on a CPU-only machine the table's CPU path: ``torch``).
"""
from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

from ._io import atomic_write

__all__ = ["BenchConfig", "run", "format_table", "plot"]

GB = 1e9


@dataclass
class BenchConfig:
    """What to measure."""

    device: str
    rows: int
    dim: int
    batches: List[int]
    repeats: int
    warmup: int
    seed: int = 0

    @classmethod
    def make(cls, device: str, quick: bool = False, rows: Optional[int] = None, dim: int = 128,
             batches: Optional[List[int]] = None, repeats: Optional[int] = None,
             seed: int = 0) -> "BenchConfig":
        """Defaults: GPU 2M rows, CPU 1M rows, quick 200k rows; batches 4K..128K."""
        cuda = device == "cuda"
        if rows is None:
            rows = 200_000 if quick else (2_000_000 if cuda else 1_000_000)
        if batches is None:
            batches = [4096, 32768] if quick else [4096, 16384, 65536, 131072]
        return cls(device=device, rows=rows, dim=dim, batches=sorted(set(batches)),
                   repeats=repeats or (2 if quick else 5), warmup=1 if quick else 2, seed=seed)

    @property
    def table_bytes(self) -> int:
        return self.rows * self.dim * 4


def _timer(fn: Callable[[], object], repeats: int, warmup: int, cuda: bool) -> float:
    """Median seconds of ``fn`` (CUDA events on the current stream, or perf_counter)."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _backends(cuda: bool, wanted: Optional[List[str]] = None) -> Dict[str, str]:
    """Backend name -> '' when usable, else why not (``wanted``: names to try)."""
    if not cuda:
        return {"torch": ""}
    from .kernels import get_backend

    out = {}
    for name in wanted or ("torch", "cupy", "numba", "auto"):
        try:
            get_backend(name)
            out[name] = ""
        except Exception as exc:
            out[name] = str(exc).split(";")[0]
    return out


def _speedtorch_step_fix(opt: torch.optim.Optimizer) -> None:
    """Make SpeedTorch 0.1.6's ``OptimizerFactory`` state usable on PyTorch 2.x, the one
    change the benchmarks make to it: it seeds ``state['step'] = 0`` (a Python int) and
    torch's Adam needs a tensor there, so each int step becomes
    ``torch.tensor(float(step))``, what Adam's own state init creates: on the CPU, or on
    the parameter's device for a ``fused`` or ``capturable`` group (where Adam keeps it)."""
    for group in opt.param_groups:
        on_param = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            st = opt.state.get(p)
            if st is not None and isinstance(st.get("step"), int):
                st["step"] = torch.tensor(float(st["step"]), device=p.device if on_param else None)


def _round_orders(names: List[str], rounds: int) -> List[List[str]]:
    """The order of a benchmark's rows in each of ``rounds`` rounds: as given, then
    reversed, and so on, so that no row always runs first: the first runs after whatever
    came before it (another method's process, the ``DataGadget`` rows, freed tables).
    Used by benchmarks/train_skipgram.py ``--rounds`` and benchmarks/compat_speedtorch.py's
    training rows."""
    return [list(names) if r % 2 == 0 else list(reversed(names)) for r in range(rounds)]


def _cprofile_tables(prof: Any, keys: tuple = ("tottime", "cumtime"), limit: int = 60) -> str:
    """A ``cProfile.Profile``'s tables as text, one sorted by each of ``keys`` (the
    benchmarks' profiling options share it)."""
    import io
    import pstats

    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    for key in keys:
        st.sort_stats(key).print_stats(limit)
    return buf.getvalue()


def _gadgets(table, folder: str, log, speedtorch: bool = True) -> Dict[str, Any]:
    """SpeedTorch's ``DataGadget(CPUPinn=True)`` over a copy of ``table`` (when SpeedTorch
    imports and ``speedtorch``), and the same call through ``stpipe.compat.speedtorch``:
    path name -> gadget. Both load one ``.npy`` written from ``table`` into ``folder``."""
    gadgets: Dict[str, Any] = {}
    path = os.path.join(folder, "speedtorch_table.npy")
    try:
        table.save(path)
        mods: Dict[str, Any] = {}
        if speedtorch:
            try:
                import SpeedTorch

                mods["speedtorch"] = SpeedTorch
            except Exception as exc:
                log(f"note: SpeedTorch not compared ({type(exc).__name__}: {exc}); "
                    "pip install SpeedTorch==0.1.6 cupy to include it")
        from .compat import speedtorch as compat

        mods["stpipe-compat"] = compat
        for name, mod in mods.items():
            try:
                gadget = mod.DataGadget(path, CPUPinn=True)
                gadget.gadgetInit()
                gadgets[name] = gadget
            except Exception as exc:
                log(f"note: {name} DataGadget failed ({type(exc).__name__}: {exc})")
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return gadgets


def _paths(table, wrappers, ids: np.ndarray, cuda: bool,
           gadgets: Optional[Dict[str, Any]] = None) -> Dict[str, Dict[str, Callable]]:
    """op -> path name -> zero-argument callable moving the batch ``ids``.

    ``wrappers`` maps a usable stpipe backend name to a HostTable over the same memory;
    ``gadgets`` a path name to a SpeedTorch-style ``DataGadget`` (see :func:`_gadgets`),
    called with numpy ids as SpeedTorch code does.
    Shared by ``python -m stpipe bench`` and ``benchmarks/transfer.py``.
    """
    from .kernels import IndexBatch

    dev = torch.device("cuda") if cuda else torch.device("cpu")
    host = table.tensor()
    k, dim, dtype = len(ids), table.dim, table.dtype
    nbytes = k * dim * table.itemsize
    idx = torch.from_numpy(ids)
    out = torch.empty((k, dim), dtype=dtype, device=dev)
    rows = torch.randn(k, dim, device=dev).to(dtype)
    gather: Dict[str, Callable] = {}
    scatter: Dict[str, Callable] = {}
    if cuda:
        pin_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        gather["limit"] = lambda: dev_buf.copy_(pin_src, non_blocking=True)
        scatter["limit"] = lambda: pin_src.copy_(dev_buf, non_blocking=True)
        gather["naive"] = lambda: host[idx].to(dev)

        def naive_scatter():
            host[idx] = rows.cpu()

        scatter["naive"] = naive_scatter
        stage = torch.empty((k, dim), dtype=dtype, pin_memory=True)

        def is_gather():
            torch.index_select(host, 0, idx, out=stage)
            out.copy_(stage, non_blocking=True)

        def is_scatter():
            stage.copy_(rows, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            host.index_copy_(0, idx, stage)

        gather["index_select"], scatter["index_select"] = is_gather, is_scatter
    else:
        flat = host.reshape(-1).view(torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        gather["limit"] = lambda: dst.copy_(flat[:nbytes])
        scatter["limit"] = lambda: flat[:nbytes].copy_(dst)
        gather["naive"] = lambda: host[idx]

        def naive_scatter_cpu():
            host[idx] = rows

        scatter["naive"] = naive_scatter_cpu
    gidx = ids.copy()
    for name, g in (gadgets or {}).items():
        gather[name] = (lambda g=g: g.getData(gidx))
        scatter[name] = (lambda g=g: g.insertData(rows, gidx))
    for name, t in wrappers.items():
        gather[f"stpipe-{name}"] = (lambda t=t: t.gather(ids, out=out))
        scatter[f"stpipe-{name}"] = (lambda t=t: t.scatter(ids, rows, assume_unique=True))
    if "auto" in wrappers:
        # the pipeline's path: one IndexBatch per batch and table (ids sort-checked and
        # uploaded once, shared by rows and state tables); here built once per batch, so the
        # row shows the transfer without the public API's per-call id checks and upload
        t = wrappers["auto"]
        planned = IndexBatch(host=ids, is_sorted=True)
        gather["stpipe-auto-planned"] = lambda: t.gather(planned, out=out)
        scatter["stpipe-auto-planned"] = lambda: t.scatter(planned, rows, assume_unique=True)
    return {"gather": gather, "scatter": scatter}


def run(cfg: BenchConfig, log: Callable[[str], None] = print) -> List[dict]:
    """Measure every path at every batch size.

    Returns:
        One dict per (batch, path): ``batch``, ``unique_rows``, ``bytes``, ``path``,
        ``gather_gbps``, ``scatter_gbps`` (missing when the path failed).
    """
    from .host import HostTable

    cuda = cfg.device == "cuda"
    table = HostTable(cfg.rows, cfg.dim, device=cfg.device, pin=cuda, backend="torch")
    table.uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(cfg.seed))
    backends = _backends(cuda)
    for name, why in backends.items():
        if why:
            log(f"note: stpipe backend {name} skipped: {why}")
    wrappers = {name: HostTable.from_tensor(table.tensor(), copy=False, backend=name,
                                            device=cfg.device, pin=cuda)
                for name, why in backends.items() if not why}
    gadgets: Dict[str, Any] = {}
    tmp = None
    if cuda:
        tmp = tempfile.TemporaryDirectory(prefix="stpipe-bench-")
        gadgets = _gadgets(table, tmp.name, log)
    log(f"table {cfg.rows:,} x {cfg.dim} float32 ({table.nbytes / GB:.2f} GB) on "
        f"{'pinned host -> ' + torch.cuda.get_device_name() if cuda else 'CPU only'}; "
        f"median of {cfg.repeats} after {cfg.warmup} warm-up")
    results: List[dict] = []
    try:
        rng = np.random.default_rng(cfg.seed)
        for batch in cfg.batches:
            ids = np.unique(rng.integers(0, cfg.rows, batch)).astype(np.int64)
            k = len(ids)
            nbytes = k * cfg.dim * 4
            paths = _paths(table, wrappers, ids, cuda, gadgets)
            per: Dict[str, dict] = {}
            for op in ("gather", "scatter"):
                for name, fn in paths[op].items():
                    try:
                        sec = _timer(fn, cfg.repeats, cfg.warmup, cuda)
                    except Exception as exc:  # a failing path is reported, not fatal
                        log(f"note: {op} {name} failed at batch {batch}: "
                            f"{type(exc).__name__}: {exc}")
                        continue
                    row = per.setdefault(name, {"batch": batch, "unique_rows": k,
                                                "bytes": nbytes, "path": name})
                    row[f"{op}_gbps"] = nbytes / sec / GB
            results += per.values()
            log(f"batch {batch:,} ({k:,} unique rows, {nbytes / 2**20:.1f} MiB) done")
            del paths
            gc.collect()
    finally:
        for w in wrappers.values():
            w.close()
        table.close()
        if tmp is not None:
            tmp.cleanup()
    return results


def format_table(results: List[dict], cfg: BenchConfig) -> str:
    """A text table: GB/s per path and its ratio to naive indexing and to the limit."""
    head = (f"{'batch':>8} {'path':<16}{'gather GB/s':>12}{'x naive':>9}{'x limit':>9}"
            f"{'scatter GB/s':>14}{'x naive':>9}{'x limit':>9}")
    lines = [head, "-" * len(head)]
    for batch in cfg.batches:
        rows = [r for r in results if r["batch"] == batch]
        ref = {r["path"]: r for r in rows}
        for r in rows:
            cells = []
            for op in ("gather", "scatter"):
                g = r.get(f"{op}_gbps")
                n = ref.get("naive", {}).get(f"{op}_gbps")
                lim = ref.get("limit", {}).get(f"{op}_gbps")
                cells.append(f"{g:.2f}" if g else "-")
                cells.append(f"{g / n:.2f}" if g and n else "-")
                cells.append(f"{g / lim:.2f}" if g and lim else "-")
            lines.append(f"{batch:>8} {r['path']:<16}{cells[0]:>12}{cells[1]:>9}{cells[2]:>9}"
                         f"{cells[3]:>14}{cells[4]:>9}{cells[5]:>9}")
    return "\n".join(lines)


def plot(results: List[dict], cfg: BenchConfig, path: str) -> None:
    """GB/s against batch size (unique rows), gather and scatter side by side.

    Written to a temporary file and renamed into place.

    Raises:
        ImportError: matplotlib is not installed.
    """
    _plot_gbps(results, path, f"table {cfg.rows:,} x {cfg.dim} ({cfg.device})")


def _plot_gbps(results: List[dict], path: str, title: str) -> None:
    """The GB/s-vs-unique-rows figure shared by this command and benchmarks/transfer.py:
    one line per path, gather and scatter side by side, written atomically as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    names = list(dict.fromkeys(r["path"] for r in results))
    try:
        for ax, op in zip(axes, ("gather", "scatter")):
            for name in names:
                pts = sorted((r["unique_rows"], r[f"{op}_gbps"]) for r in results
                             if r["path"] == name and f"{op}_gbps" in r)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("unique rows per batch")
            ax.set_title(f"{op}, {title}")
            ax.grid(True, alpha=0.3)
        axes[0].set_ylabel("GB/s")
        axes[1].legend(fontsize=8)
        fig.tight_layout()
        atomic_write(path, lambda f: fig.savefig(f, dpi=120, format="png"))
    finally:
        plt.close(fig)

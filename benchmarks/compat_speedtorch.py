"""stpipe.compat.speedtorch beside SpeedTorch 0.1.6 itself, in the same run.

Rows (each implementation on the same table, ids and machine):

* ``DataGadget.getData`` / ``insertData`` GB/s on a ``--rows x --dim`` float32 table
  (default 10M x 128, 5.12 GB) for batches of ``--batch`` random ids (131,072: 64 MiB),
  with ``CPUPinn=True`` (pinned host table) and ``CPUPinn=False`` (GPU-resident table).
  GB/s counts the bytes of the requested rows (``batch * dim * 4``); insertData uses
  distinct ids (SpeedTorch keeps a random one of duplicates). SpeedTorch is given its ids
  as CuPy arrays (its tables are CuPy arrays); stpipe is measured twice, with numpy ids
  and with those same CuPy arrays ("stpipe (CuPy ids)": the same user code).
* The speedtorch-api.md skip-gram training pattern, steps/s: ``ModelFactory(...,
  CPUPinn=True)`` for both embeddings (``--rows`` rows each), batch 512 x (4 positive +
  64 negative) context ids drawn Zipf(1.2) (many duplicates), dim 128, SGD (lr 0.05).
  Two optimizers for each implementation: SGD (lr 0.05) through ``ModelFactory`` alone, and
  Adam (lr 1e-3) with ``OptimizerFactory`` switching its state too. SpeedTorch 0.1.6's
  ``OptimizerFactory`` fails on PyTorch 2.x as shipped (it seeds ``state['step'] = 0``, a
  Python int, where Adam wants a tensor); its Adam row makes one change, replacing each
  int step by ``torch.tensor(0.0)`` right after the factories are built (what Adam itself
  would create). stpipe's compat layer needs no such change. With duplicate ids the two
  do different work: SpeedTorch moves and updates every occurrence, stpipe each distinct
  row once (its documented semantics).

Timing: ``torch.cuda.synchronize()`` before and after each timed block (wall clock);
median of ``--repeats``. Every row runs ``--rounds`` times (default 2), the order
reversed each round, and reports its fastest round (every round's figure is kept): a
single pass in one order gave the same SGD row 1.19x and 0.95x SpeedTorch in two runs an
hour apart, and the GPU-resident ``insertData`` row 1.34x and 0.62x. SpeedTorch rows are
skipped, with a note, when it (or CuPy) does not import.

    python benchmarks/compat_speedtorch.py [--quick] [--out DIR] [--rows N]

Writes ``DIR/compat_speedtorch.json`` and ``DIR/compat_speedtorch.md`` when ``--out``.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np
import torch

from stpipe._bench import _cprofile_tables, _round_orders, _speedtorch_step_fix


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_s(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _zipf(rng: np.random.Generator, shape, rows: int, a: float = 1.2) -> np.ndarray:
    n = int(np.prod(shape))
    out = np.empty(0, dtype=np.int64)
    while out.size < n:
        z = rng.zipf(a, 2 * n)
        out = np.concatenate([out, z[z <= rows] - 1])
    return out[:n].astype(np.int64).reshape(shape)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:  # CuPy's pools, when SpeedTorch ran
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
    except Exception:
        pass


def _speedtorch():
    try:
        import SpeedTorch  # noqa: N813

        return SpeedTorch, None
    except Exception as exc:  # missing wheel, or CuPy missing/broken
        return None, f"{type(exc).__name__}: {exc}"


def _make_table_file(path: str, rows: int, dim: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, dim))
    step = max(1, (256 << 20) // (dim * 4))
    for a in range(0, rows, step):
        b = min(rows, a + step)
        mm[a:b] = rng.random((b - a, dim), dtype=np.float32) - 0.5
    mm.flush()
    del mm


# ---------------------------------------------------------------------------------------
def bench_gadget(impls: dict, path: str, rows: int, dim: int, batch: int, repeats: int,
                 rounds: int = 1) -> list:
    """The DataGadget rows, each configuration measured ``rounds`` times, the order of
    the configurations reversed in every other round; each row keeps its fastest round
    of each call (every round's GB/s under ``getData_rounds`` / ``insertData_rounds``)."""
    rng = np.random.default_rng(1)
    ids_get = rng.integers(0, rows, batch)
    ids_put = rng.choice(rows, batch, replace=False)
    gb = batch * dim * 4 / 1e9
    runs = []  # (row name, module, ids on the GPU as CuPy arrays?, CPUPinn)
    for name, mod in impls.items():
        if name == "SpeedTorch":
            variants = [(name, mod, True)]
        else:  # numpy ids, and the very ids SpeedTorch is given (CuPy), when CuPy is here
            variants = [(name, mod, False)]
            if importlib.util.find_spec("cupy") is not None and "SpeedTorch" in impls:
                variants.append((name + " (CuPy ids)", mod, True))
        runs += [v + (pin,) for v in variants for pin in (True, False)]
    seen: dict = {}
    for order in _round_orders(list(range(len(runs))), rounds):
        for i in order:
            name, mod, cupy_ids, pin = runs[i]
            g = mod.DataGadget(path, CPUPinn=pin)
            t0 = time.perf_counter()
            g.gadgetInit()
            load_s = time.perf_counter() - t0
            if cupy_ids:
                import cupy

                get_ids, put_ids = cupy.asarray(ids_get), cupy.asarray(ids_put)
            else:
                get_ids, put_ids = ids_get, ids_put
            rows_t = torch.randn(batch, dim, device="cuda")
            t_get = _median_s(lambda: g.getData(get_ids), repeats)
            t_put = _median_s(lambda: g.insertData(rows_t, put_ids), repeats)
            print(f"  DataGadget {name:10s} CPUPinn={pin!s:5s} getData {gb / t_get:6.1f} GB/s"
                  f"  insertData {gb / t_put:6.1f} GB/s  (gadgetInit {load_s:.1f} s)", flush=True)
            res = seen.setdefault(i, dict(impl=name, CPUPinn=pin, getData_rounds=[], insertData_rounds=[],
                                          load_s=load_s))
            res["getData_rounds"].append(gb / t_get)
            res["insertData_rounds"].append(gb / t_put)
            del g, rows_t
            _free()
    out = []
    for i in range(len(runs)):
        res = seen[i]
        for call in ("getData", "insertData"):  # the fastest round
            res[f"{call}_GBps"] = best = max(res[f"{call}_rounds"])
            res[f"{call}_ms"] = gb / best * 1e3
        out.append(res)
    return out


class SkipGram(torch.nn.Module):
    def __init__(self, n_u: int, n_v: int, dim: int) -> None:
        super().__init__()
        self.u_embeddings = torch.nn.Embedding(n_u, dim)
        self.v_embeddings = torch.nn.Embedding(n_v, dim)

    def forward(self, pos_u, pos_v, neg_v):
        F = torch.nn.functional
        emb_u = self.u_embeddings(pos_u)
        emb_v = self.v_embeddings(pos_v)
        emb_n = self.v_embeddings(neg_v)
        score = F.logsigmoid((emb_u * emb_v).sum(-1)).sum()
        neg = F.logsigmoid(-torch.bmm(emb_n, emb_u.transpose(1, 2))).sum()
        return -(score + neg) / pos_u.shape[0]


def bench_train(name: str, mod, optim: str, rows: int, dim: int, steps: int,
                B: int = 512, P: int = 4, N: int = 64, profile: str | None = None) -> dict:
    """One training row; ``profile``: a directory where the timed steps' cProfile
    tables (cumulative and own time) are written (the row's speed then includes
    cProfile's overhead)."""
    rng = np.random.default_rng(2)
    batches = [(rng.integers(0, rows, (B, 1)), _zipf(rng, (B, P), rows), _zipf(rng, (B, N), rows))
               for _ in range(16)]
    uniq = np.mean([np.unique(np.concatenate([v.ravel(), n.ravel()])).size for _, v, n in batches])
    model = SkipGram(B, B * (P + N), dim).cuda()
    us = mod.ModelFactory(model.u_embeddings, rows, dim, CPUPinn=True)
    vs = mod.ModelFactory(model.v_embeddings, rows, dim, CPUPinn=True)
    t0 = time.perf_counter()
    us.uniformDistributionInit(-0.5 / dim, 0.5 / dim)
    vs.uniformDistributionInit(-0.5 / dim, 0.5 / dim)
    init_s = time.perf_counter() - t0
    switches = [(us, 0), (vs, 1)]
    if optim == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        uo = mod.OptimizerFactory(opt, rows, dim, model, "u_embeddings", CPUPinn=True)
        vo = mod.OptimizerFactory(opt, rows, dim, model, "v_embeddings", CPUPinn=True)
        if mod.__name__ == "SpeedTorch":
            _speedtorch_step_fix(opt)
        uo.optInit()
        vo.optInit()
        switches += [(uo, 0), (vo, 1)]
    ud = torch.as_tensor(us.variableTransformer(B, 1), device="cuda")
    pd, nd = (torch.as_tensor(a, device="cuda") for a in vs.variableTransformer(B, P, N))
    losses = []

    def step(i: int) -> None:
        u, v, n = batches[i % len(batches)]
        args = [(u,), (v, n)]
        for s, j in switches:
            s.beforeForwardPass(*args[j])
        loss = model(ud, pd, nd)
        opt.zero_grad()
        loss.backward()
        opt.step()
        for s, j in switches:
            s.afterOptimizerStep(*args[j])
        losses.append(loss.detach())

    for i in range(20):  # warm-up: kernels compiled, backend choices made
        step(i)
    _sync()
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t, c = time.perf_counter(), time.thread_time()
    for i in range(steps):
        step(i)
    _sync()
    dt, cpu = time.perf_counter() - t, time.thread_time() - c
    if prof is not None:
        prof.disable()
        _write_profile(prof, profile, f"{name}_{optim}", steps)
    res = dict(impl=name, optimizer=optim, steps_per_s=steps / dt, ms_per_step=dt / steps * 1e3,
               cpu_ms_per_step=cpu / steps * 1e3, init_s=init_s, final_loss=float(losses[-1]), mean_unique_v_rows=float(uniq),
               v_ids_per_step=B * (P + N))
    print(f"  skip-gram  {name:10s} {optim:4s} {res['steps_per_s']:8.1f} steps/s "
          f"({res['ms_per_step']:.2f} ms/step, CPU {res['cpu_ms_per_step']:.2f} ms; init {init_s:.1f} s; loss {res['final_loss']:.4f})",
          flush=True)
    del us, vs, switches, model, opt
    _free()
    return res


def _write_profile(prof, out_dir: str, tag: str, steps: int) -> None:
    """cProfile tables of the timed steps: by cumulative and by own time."""
    os.makedirs(out_dir, exist_ok=True)
    for key in ("cumulative", "tottime"):
        with open(os.path.join(out_dir, f"profile_{tag}_{key}.txt"), "w") as f:
            f.write(f"# {tag}: {steps} timed steps under cProfile, sorted by {key}\n")
            f.write(_cprofile_tables(prof, (key,)))


# ---------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1M rows, fewer repeats/steps")
    ap.add_argument("--out", default=None, help="write compat_speedtorch.{json,md} here")
    ap.add_argument("--rows", type=int, default=None, help="table rows (default 10M; 1M with --quick)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=131_072, help="DataGadget ids per call")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed training steps")
    ap.add_argument("--skip", choices=["gadget", "train"], action="append", default=[])
    ap.add_argument("--only", choices=["stpipe", "SpeedTorch"], default=None,
                    help="training rows of this implementation only")
    ap.add_argument("--optims", default="sgd,adam", help="training rows' optimizers (sgd, adam)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="every row runs this many times, the order reversed each round; "
                         "each row reports its fastest round")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="run the training rows under cProfile; tables written to DIR")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if not torch.cuda.is_available():
        print("needs CUDA: the compared paths move rows to a GPU", file=sys.stderr)
        return 2
    rows = args.rows or (1_000_000 if args.quick else 10_000_000)
    repeats = args.repeats or (5 if args.quick else 15)
    steps = args.steps or (30 if args.quick else 200)
    warnings.simplefilter("ignore")
    import stpipe
    import stpipe.compat.speedtorch as compat

    st, why = _speedtorch()
    impls = {"stpipe": compat}
    if st is not None:
        impls["SpeedTorch"] = st
    else:
        print(f"SpeedTorch rows skipped: {why}")
    info = dict(date=time.strftime("%Y-%m-%d %H:%M:%S"), python=sys.version.split()[0],
                torch=torch.__version__, stpipe=stpipe.__version__, gpu=torch.cuda.get_device_name(),
                host=platform.node(), cpus=os.cpu_count(), rows=rows, dim=args.dim,
                batch=args.batch, repeats=repeats, steps=steps,
                speedtorch=None if st is None else getattr(st, "__version__", "0.1.6"),
                speedtorch_missing=why, command=" ".join([sys.executable] + sys.argv))
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except Exception:
        info["cupy"] = None
    print(json.dumps(info))
    result = dict(info=info, gadget=[], train=[])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        if "gadget" not in args.skip:
            path = os.path.join(tmp, "table.npy")
            t = time.perf_counter()
            _make_table_file(path, rows, args.dim)
            print(f"table file {rows}x{args.dim} written in {time.perf_counter() - t:.1f} s", flush=True)
            result["gadget"] = bench_gadget(impls, path, rows, args.dim, args.batch, repeats, args.rounds)
            os.unlink(path)
    if "train" not in args.skip:
        names = [n for n in impls if not args.only or n == args.only]
        for optim in [o for o in args.optims.split(",") if o]:
            if optim not in ("sgd", "adam"):
                raise SystemExit(f"--optims: expected sgd and/or adam, got {optim!r}")
            runs: dict = {n: [] for n in names}
            for order in _round_orders(names, args.rounds):
                for name in order:
                    try:
                        runs[name].append(bench_train(name, impls[name], optim, rows, args.dim, steps,
                                                      profile=args.profile))
                    except Exception as exc:  # report, go on with the other rows
                        print(f"  skip-gram  {name} {optim} failed: {type(exc).__name__}: {exc}",
                              flush=True)
                        runs[name].append(dict(impl=name, optimizer=optim,
                                               error=f"{type(exc).__name__}: {exc}"))
            for name in names:
                result["train"].append(_best_round(runs[name]))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "compat_speedtorch.json"), "w") as f:
            json.dump(result, f, indent=2)
        with open(os.path.join(args.out, "compat_speedtorch.md"), "w") as f:
            f.write(_markdown(result))
    print(_markdown(result))
    return 0


def _best_round(runs: list) -> dict:
    """One row from its rounds: the fastest that did not fail (else the first), with
    every round's steps/s kept under ``rounds_steps_per_s``."""
    ok = [x for x in runs if "error" not in x]
    best = dict(max(ok, key=lambda x: x["steps_per_s"]) if ok else runs[0])
    best["rounds_steps_per_s"] = [x.get("steps_per_s") for x in runs]
    return best


def _markdown(r: dict) -> str:
    i = r["info"]
    lines = [f"## stpipe.compat.speedtorch vs SpeedTorch 0.1.6 ({i['date']})", "",
             f"{i['gpu']}, {i['cpus']} CPUs; torch {i['torch']}, CuPy {i['cupy']}; "
             f"table {i['rows']:,} x {i['dim']} float32; `{i['command']}`", ""]
    if i.get("speedtorch_missing"):
        lines += [f"SpeedTorch did not import ({i['speedtorch_missing']}): its rows are missing.", ""]
    if r["gadget"]:
        lines += [f"DataGadget, {i['batch']:,} ids per call (fastest round; every round's GB/s "
                  "after it; x SpeedTorch for the rows given SpeedTorch's CuPy ids):", "",
                  "| impl | CPUPinn | getData GB/s | insertData GB/s |", "| --- | --- | --- | --- |"]
        base = {g["CPUPinn"]: g for g in r["gadget"] if g["impl"] == "SpeedTorch"}

        def cell(g: dict, key: str) -> str:
            txt = f"{g[key + '_GBps']:.1f}"
            b = base.get(g["CPUPinn"])
            if b is not None and g["impl"].endswith("(CuPy ids)"):
                txt += f" ({g[key + '_GBps'] / b[key + '_GBps']:.2f}x)"
            rounds = g.get(key + "_rounds") or []
            if len(rounds) > 1:
                txt += " [" + ", ".join(f"{x:.1f}" for x in rounds) + "]"
            return txt

        lines += [f"| {g['impl']} | {g['CPUPinn']} | {cell(g, 'getData')} | {cell(g, 'insertData')} |"
                  for g in r["gadget"]]
        lines.append("")
    if r["train"]:
        lines += ["Skip-gram pattern (ModelFactory CPUPinn=True, batch 512 x (4+64) Zipf ids):", "",
                  "| impl | optimizer | steps/s (fastest round) | ms/step | every round's steps/s |",
                  "| --- | --- | --- | --- | --- |"]
        rate = {(t["impl"], t["optimizer"]): t.get("steps_per_s") for t in r["train"]}
        for t in r["train"]:
            opt = t["optimizer"] + (" + OptimizerFactory" if t["optimizer"] == "adam" else "")
            if "error" in t:
                lines.append(f"| {t['impl']} | {opt} | failed: {t['error']} | | |")
                continue
            base = rate.get(("SpeedTorch", t["optimizer"]))
            vs = f" ({t['steps_per_s'] / base:.2f}x SpeedTorch)" if base and t["impl"] != "SpeedTorch" else ""
            rounds = ", ".join("failed" if x is None else f"{x:.1f}" for x in t.get("rounds_steps_per_s", []))
            lines.append(f"| {t['impl']} | {opt} | {t['steps_per_s']:.1f}{vs} | {t['ms_per_step']:.2f} "
                         f"| {rounds} |")
        lines += ["", "SpeedTorch's Adam row: its OptimizerFactory's int `step` state replaced by a tensor "
                  "(it fails on PyTorch 2.x as shipped); nothing else changed."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

"""The command line: ``python -m stpipe info | bench | demo`` (private).

Each subcommand imports what it needs only when it runs, so ``import stpipe`` stays free of
CuPy, numba, matplotlib and the demo's corpus code. Argument errors are argparse's (exit
status 2 with a usage line); :class:`stpipe.StpipeError` and other clear user errors print
``stpipe <command>: error: ...`` and exit with status 1; Ctrl-C exits with status 130.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import sys
import time
import importlib.util
from typing import Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["main", "build_parser", "info_lines"]


# --------------------------------------------------------------------------- info

def _dist_version(*names: str) -> Optional[str]:
    """Version of the first installed distribution among ``names``, else None."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _module_version(module: str, dists: Sequence[str]) -> str:
    """``"1.2.3"``, ``"not installed"`` or ``"1.2.3 (import fails: ...)"``.

    CuPy and numba are imported here only, inside ``python -m stpipe info``.
    """
    version = _dist_version(*dists)
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        if version is None:
            return "not installed"
        return f"{version} (import fails: {_one_line(exc)})"
    except Exception as exc:  # broken installs raise all sorts of things
        return f"{version or '?'} (import fails: {_one_line(exc)})"
    return str(getattr(mod, "__version__", None) or version or "unknown version")


def _one_line(exc: BaseException, limit: int = 160) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def meminfo() -> Dict[str, int]:
    """``/proc/meminfo`` as ``{field: bytes}``; empty where there is no such file."""
    out: Dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if not parts:
                    continue
                value = int(parts[0])
                if len(parts) > 1 and parts[1].lower() == "kb":
                    value *= 1024
                out[key.strip()] = value
    except (OSError, ValueError):
        return {}
    return out


def available_ram() -> Optional[int]:
    """Bytes of RAM available for new allocations (``MemAvailable``), or None if unknown."""
    info = meminfo()
    if "MemAvailable" in info:
        return info["MemAvailable"]
    if hasattr(os, "sysconf"):
        try:
            return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError):
            return None
    return None


def fmt_bytes(n: Optional[float]) -> str:
    """``1.5 GiB`` style; ``unknown`` for None."""
    if n is None:
        return "unknown"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _launch_report() -> str:
    """How the CuPy backend and the upload ring call the CUDA driver (stpipe._calls)."""
    try:
        from stpipe import _calls  # noqa: F401
    except ImportError:
        return "ctypes and torch copies (stpipe._calls is not built: reinstall to compile it)"
    from stpipe._cuda import driver_calls

    if driver_calls() is None:
        return "compiled stpipe._calls built; not bound (no libcuda.so.1, or STPIPE_DRIVER_CALLS=0)"
    return "compiled (stpipe._calls bound to libcuda.so.1)"


def _backend_report() -> List[Tuple[str, str]]:
    """``[(name, status)]`` for each transfer backend; never raises."""
    try:
        kernels = importlib.import_module("stpipe.kernels")
    except ImportError as exc:
        return [("(none)", f"stpipe.kernels not available: {_one_line(exc)}")]
    names = getattr(kernels, "BACKENDS", ("torch", "cupy", "numba"))
    get = getattr(kernels, "get_backend", None)
    if get is None:
        return [("(none)", "stpipe.kernels has no get_backend()")]
    out = []
    for name in names:
        if name == "auto":
            continue
        try:
            get(name)
        except Exception as exc:
            out.append((name, f"unavailable ({_one_line(exc)})"))
        else:
            out.append((name, "usable"))
    return out


def info_lines() -> List[str]:
    """The lines ``python -m stpipe info`` prints."""
    import numpy as np
    import torch

    import stpipe
    from stpipe import planner

    lines = [
        f"stpipe      {stpipe.__version__} ({os.path.dirname(stpipe.__file__)})",
        f"python      {platform.python_version()} ({sys.executable})",
        f"platform    {platform.platform()}",
        f"torch       {torch.__version__} (built with CUDA {torch.version.cuda or 'none'})",
        f"numpy       {np.__version__}",
        f"cupy        {_module_version('cupy', ('cupy', 'cupy-cuda12x', 'cupy-cuda13x', 'cupy-cuda11x'))}",
        f"numba       {_module_version('numba', ('numba',))}",
        f"numba-cuda  {_dist_version('numba-cuda') or 'not installed'}",
        f"tqdm        {_dist_version('tqdm') or 'not installed'}",
        f"matplotlib  {_dist_version('matplotlib') or 'not installed'}",
    ]
    try:
        cuda = bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - broken driver
        cuda = False
    lines.append(f"CUDA        {'available' if cuda else 'not available'}")
    if cuda:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            try:
                free, total = torch.cuda.mem_get_info(i)
                mem = f"{fmt_bytes(free)} free of {fmt_bytes(total)}"
            except Exception:
                mem = f"{fmt_bytes(props.total_memory)} total"
            lines.append(
                f"GPU {i}       {props.name}, {mem}, compute capability {props.major}.{props.minor}"
            )
    else:
        lines.append("GPU         none (everything runs on the CPU)")
    try:
        impl = planner.implementation()
    except Exception as exc:
        impl = f"error: {_one_line(exc)}"
    lines.append(f"planner     {impl}")
    lines.append(f"launches    {_launch_report()}")
    for name, status in _backend_report():
        lines.append(f"backend     {name}: {status}")
    avail = available_ram()
    lines.append(
        f"pinnable    about {fmt_bytes(avail)} (estimate: MemAvailable from /proc/meminfo; "
        "page-locking cannot exceed free RAM and the OS needs some of it)"
    )
    return lines


def _cmd_info(args: argparse.Namespace) -> int:
    for line in info_lines():
        print(line)
    return 0


# --------------------------------------------------------------------------- parser

class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors name the subcommand (argparse's own format)."""


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: ...)`` only where there is a meaningful default."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m stpipe`` argument parser."""
    parser = _Parser(
        prog="python -m stpipe",
        description="stpipe: train embedding tables larger than GPU memory.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{info,bench,demo}", parser_class=_Parser)
    sub.required = True

    p_info = sub.add_parser(
        "info", help="versions, CUDA, GPU, planner, transfer backends, pinnable memory",
        description="Print versions, CUDA and GPU, the active planner implementation, the "
        "usable transfer backends and an estimate of the memory that can be pinned.",
    )
    p_info.set_defaults(func=_cmd_info)
    _add_more_commands(sub)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _nonneg_int(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


#: Default cap on corpus words read by ``demo`` (keeps a CPU run under 2 minutes).
DEMO_MAX_TOKENS = 2_000_000


def _add_more_commands(sub) -> None:
    """``bench`` and ``demo``."""
    p_bench = sub.add_parser(
        "bench", help="gather/scatter bandwidth of the transfer paths on this machine",
        description="Measure host-table gather/scatter bandwidth (GB/s) of naive indexing, "
        "index_select with staging, and each usable stpipe backend against the contiguous "
        "copy limit, for several batch sizes, and print a table with ratios. CPU-only "
        "machines compare the torch backend with naive indexing.",
    )
    p_bench.add_argument("--quick", action="store_true",
                         help="small table, two batch sizes, few repeats (seconds)")
    p_bench.add_argument("--rows", type=_positive_int, default=None,
                         help="table rows (default 2,000,000 on GPU, 1,000,000 on CPU; "
                         "--quick: 200,000)")
    p_bench.add_argument("--dim", type=_positive_int, default=128, help="row width (default 128)")
    p_bench.add_argument("--batch", type=_positive_int, action="append", default=None,
                         metavar="N", help="batch size in rows (repeat for several)")
    p_bench.add_argument("--repeats", type=_positive_int, default=None,
                         help="timed repeats per point (default 5, --quick 2)")
    p_bench.add_argument("--device", choices=("cpu", "cuda"), default=None,
                         help="default: cuda when available")
    p_bench.add_argument("--plot", metavar="FILE.png", default=None,
                         help="draw GB/s vs batch size (needs matplotlib)")
    p_bench.add_argument("--seed", type=int, default=0, help="seed of the random ids")
    p_bench.set_defaults(func=_cmd_bench)

    p_demo = sub.add_parser(
        "demo", help="train word2vec (skip-gram, negative sampling) through host tables",
        formatter_class=_Defaults,
        description="Train a skip-gram word2vec model with negative sampling and fastText "
        "character n-gram buckets; the input table (vocabulary + buckets rows), the output "
        "table and the optimizer state live in stpipe host tables and train through the "
        "prefetch pipeline. The default corpus is the source of the installed Python "
        "standard library. At the end it prints nearest neighbours of probe words and the "
        "throughput. By default only the first --max-tokens words (files in a seeded random "
        "order) are read, so a CPU-only run finishes in about 2 minutes on 2 cores; pass "
        "--max-tokens 0 for the whole corpus.",
    )
    p_demo.add_argument("--corpus", metavar="PATH", default=None,
                        help="text file or folder (default: the standard library's *.py files)")
    p_demo.add_argument("--max-tokens", type=_nonneg_int, default=DEMO_MAX_TOKENS,
                        help="read at most this many corpus words (0: no cap)")
    p_demo.add_argument("--epochs", type=_positive_int, default=1, help="passes over the corpus")
    p_demo.add_argument("--dim", type=_positive_int, default=64, help="embedding dimension")
    p_demo.add_argument("--buckets", type=_nonneg_int, default=2_000_000,
                        help="hashed character n-gram rows (0: words only)")
    p_demo.add_argument("--window", type=_positive_int, default=5, help="largest context window")
    p_demo.add_argument("--negatives", type=_positive_int, default=5,
                        help="noise words per (centre, context) pair")
    p_demo.add_argument("--batch", type=_positive_int, default=1024, help="centre words per step")
    p_demo.add_argument("--min-count", type=_positive_int, default=5,
                        help="drop words rarer than this")
    p_demo.add_argument("--subsample", type=_nonneg_float, default=1e-4,
                        help="frequent-word subsampling threshold (0: off)")
    p_demo.add_argument("--optimizer", choices=("adam", "adagrad", "sgd"), default="adam",
                        help="dense optimizer run by the pipeline on each step's rows")
    p_demo.add_argument("--lr", type=_positive_float, default=None,
                        help="learning rate (default: adam 0.03, adagrad 0.2, sgd 0.01)")
    p_demo.add_argument("--seed", type=int, default=0, help="seed of everything random")
    p_demo.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where the working rows train (default: cuda when available)")
    p_demo.add_argument("--engine", choices=("stpipe", "torch"), default="stpipe",
                        help="stpipe: host tables + pipeline; torch: the nn.Embedding(sparse=True) "
                        "+ sparse optimizer reference, whole tables on --device")
    p_demo.add_argument("--out", metavar="PATH", default=None,
                        help="save word vectors and vocabulary to this .npz (written atomically)")
    p_demo.add_argument("--load", metavar="PATH", default=None,
                        help="skip training: load vectors saved with --out and print neighbours")
    p_demo.add_argument("--probe", metavar="WORD", action="append", default=None,
                        help="word whose neighbours to print (repeatable; default: "
                        "append socket thread encode sort exception)")
    p_demo.add_argument("--neighbours", type=_positive_int, default=8, metavar="K",
                        help="neighbours printed per probe word")
    p_demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    p_demo.set_defaults(func=_cmd_demo)


# --------------------------------------------------------------------------- demo

def _rss_bytes() -> Optional[int]:
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _resolve_device(name: Optional[str]) -> str:
    import torch

    cuda = torch.cuda.is_available()
    if name is None:
        return "cuda" if cuda else "cpu"
    if name == "cuda" and not cuda:
        raise CliError("--device cuda was given but CUDA is not available here "
                       "(see `python -m stpipe info`); use --device cpu")
    return name


def _check_memory(need: int, what: str) -> None:
    avail = available_ram()
    if avail is not None and need > 0.9 * avail:
        raise CliError(
            f"{what} needs about {fmt_bytes(need)} of host memory but only {fmt_bytes(avail)} "
            "is available (MemAvailable); lower --buckets or --dim, or use --optimizer sgd "
            "(no per-row state)"
        )


def _check_out_path(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        raise CliError(f"--out {path!r} is a folder; give a file name such as vectors.npz")
    if not os.path.isdir(folder):
        raise CliError(f"--out {path!r}: folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise CliError(f"--out {path!r}: folder {folder!r} is not writable")
    import tempfile

    try:  # os.access says yes to root anywhere, and nothing of special filesystems
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".stpipe-probe-"):
            pass
    except OSError as exc:
        raise CliError(f"--out {path!r}: cannot create a file in {folder!r} ({exc.strerror or exc})") from None


def _print_neighbours(words, vectors, probes, k, oov_vector=None) -> None:
    from . import _demo

    index = {w: i for i, w in enumerate(words)}
    print(f"nearest neighbours (cosine, {len(words):,} words):")
    for probe in probes:
        p = probe.lower()
        if p in index:
            i = index[p]
            got = _demo.neighbours(vectors, words, vectors[i], k, exclude=[i])
            tag = ""
        else:
            q = oov_vector(p) if oov_vector is not None else None
            if q is None:
                print(f"  {probe:>12}: not in the vocabulary")
                continue
            got = _demo.neighbours(vectors, words, q, k)
            tag = " (out of vocabulary: from its n-grams)"
        text = ", ".join(f"{w} {s:.2f}" for w, s in got)
        print(f"  {probe:>12}: {text}{tag}")


def _cmd_demo(args: argparse.Namespace) -> int:
    from . import _corpus, _demo

    probes = args.probe or list(_demo.PROBES)
    if args.load is not None:
        try:
            words, vectors, _ = _demo.load_vectors(args.load)
        except _corpus.CorpusError as exc:
            raise CliError(str(exc)) from None
        _print_neighbours(words, vectors, probes, args.neighbours)
        return 0

    device = _resolve_device(args.device)
    if args.out is not None:
        _check_out_path(args.out)
    cfg = _demo.DemoConfig(
        dim=args.dim, window=args.window, negatives=args.negatives, batch=args.batch,
        epochs=args.epochs, lr=args.lr, optimizer=args.optimizer, subsample=args.subsample,
        min_count=args.min_count, buckets=args.buckets, seed=args.seed, device=device,
        engine=args.engine,
    )
    if cfg.engine == "stpipe" and not _demo.stpipe_available():
        raise CliError("stpipe.HostEmbedding / stpipe.Pipeline are not importable; "
                       "use --engine torch")
    # a first memory check before reading anything: the buckets alone
    _check_memory(_demo.table_bytes(cfg.buckets, cfg.dim, cfg.optimizer),
                  f"an input table of {cfg.buckets:,} buckets x {cfg.dim}")
    t0 = time.perf_counter()
    try:
        corpus = _corpus.read_corpus(args.corpus, max_tokens=args.max_tokens or None,
                                     seed=cfg.seed)
        vocab = _corpus.build_vocab(corpus, cfg.min_count)
    except _corpus.CorpusError as exc:
        raise CliError(str(exc)) from None
    need = (_demo.table_bytes(len(vocab) + cfg.buckets, cfg.dim, cfg.optimizer)
            + _demo.table_bytes(len(vocab), cfg.dim, cfg.optimizer))
    _check_memory(need, f"tables of {len(vocab) + cfg.buckets:,} + {len(vocab):,} rows x {cfg.dim}"
                  f" with {cfg.optimizer} state")
    data = _demo.SkipGramData(corpus, vocab, cfg)
    src = args.corpus or f"Python standard library ({_corpus.default_corpus_root()})"
    capped = (f", capped by --max-tokens {args.max_tokens:,}"
              if args.max_tokens and corpus.files_total > len(corpus.files) else "")
    print(f"corpus: {src}: {len(corpus):,} words from {len(corpus.files):,} of "
          f"{corpus.files_total:,} files{capped} (read in {time.perf_counter() - t0:.1f} s)")
    print(f"model: vocabulary {len(vocab):,} words (min count {cfg.min_count}), "
          f"{cfg.buckets:,} n-gram buckets; input table {data.in_rows:,} x {cfg.dim}, output "
          f"table {data.out_rows:,} x {cfg.dim}; {cfg.optimizer} (lr {cfg.learning_rate:g}); "
          f"host tables + state {fmt_bytes(need)}; device {device}; engine {cfg.engine}")

    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(data.ids) * cfg.epochs, unit="tok", unit_scale=True,
                   dynamic_ncols=True, desc="training", file=sys.stderr)
    state = {"loss": None, "seen": 0}

    def progress(res, batch) -> None:
        if len(res.losses) > state["seen"]:
            for loss in res.losses[state["seen"]:]:
                state["loss"] = (loss if state["loss"] is None
                                 else 0.98 * state["loss"] + 0.02 * loss)
            state["seen"] = len(res.losses)
        if bar is not None:
            bar.update(batch.tokens)
            if res.steps % 10 == 1 and state["loss"] is not None:
                post = {"loss": f"{state['loss']:.3f}", "host": fmt_bytes(_rss_bytes())}
                if device == "cuda":
                    import torch

                    post["gpu"] = fmt_bytes(torch.cuda.memory_allocated())
                bar.set_postfix(post, refresh=False)

    try:
        res = _demo.train(data, cfg, progress)
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        print("\nstpipe demo: interrupted; training stopped, nothing saved"
              + (f" ({args.out!r} untouched)" if args.out else ""), file=sys.stderr)
        return 130
    finally:
        if bar is not None:
            bar.close()
    vectors = res.vectors()
    loss_tail = res.losses[-50:] or [float("nan")]
    print(f"trained {res.tokens:,} corpus tokens ({res.centres:,} centre words after "
          f"subsampling, {res.pairs:,} pairs, {res.steps:,} steps) in {res.seconds:.1f} s: "
          f"{res.tokens_per_s:,.0f} tokens/s, {res.pairs / max(res.seconds, 1e-9):,.0f} pairs/s; "
          f"final loss {sum(loss_tail) / len(loss_tail):.3f} per pair")

    def oov_vector(word):
        rows = _corpus.oov_rows(word, cfg.buckets, len(vocab), cfg.minn, cfg.maxn)
        if rows.size == 0:
            return None
        return res.in_table[rows].mean(0).numpy()

    _print_neighbours(vocab.words, vectors, probes, args.neighbours, oov_vector)
    if args.out is not None:
        meta = dict(dim=cfg.dim, buckets=cfg.buckets, seed=cfg.seed, optimizer=cfg.optimizer)
        try:
            _demo.save_vectors(args.out, vocab.words, vectors, **meta)
        except OSError as exc:  # checked at the start; the disk may fill or go meanwhile
            import tempfile

            spare = os.path.join(tempfile.gettempdir(), f"stpipe-vectors-{os.getpid()}.npz")
            _demo.save_vectors(spare, vocab.words, vectors, **meta)
            print(f"stpipe demo: error: could not save to {args.out!r} ({exc}); the trained "
                  f"vectors are in {spare} (reload: python -m stpipe demo --load {spare})",
                  file=sys.stderr)
            return 1
        print(f"saved {len(vocab):,} word vectors to {args.out} "
              f"(reload: python -m stpipe demo --load {args.out})")
    return 0


# --------------------------------------------------------------------------- bench

def _cmd_bench(args: argparse.Namespace) -> int:
    from . import _bench

    device = _resolve_device(args.device)
    if args.plot is not None:
        _check_out_path(args.plot)
        if importlib.util.find_spec("matplotlib") is None:
            raise CliError("--plot needs matplotlib, which is not installed "
                           "(pip install matplotlib, or pip install -e '.[bench]')")
    cfg = _bench.BenchConfig.make(device=device, quick=args.quick, rows=args.rows, dim=args.dim,
                                  batches=args.batch, repeats=args.repeats, seed=args.seed)
    _check_memory(cfg.table_bytes * 2, f"a benchmark table of {cfg.rows:,} x {cfg.dim}")
    results = _bench.run(cfg, log=lambda s: print(s, file=sys.stderr))
    print(_bench.format_table(results, cfg))
    if args.plot is not None:
        _bench.plot(results, cfg, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print(f"\nstpipe {args.command}: interrupted", file=sys.stderr)
        return 130
    except CliError as exc:
        print(f"stpipe {args.command}: error: {exc}", file=sys.stderr)
        return 1


class CliError(Exception):
    """A clear user-facing error (bad corpus, too little memory, ...): exit status 1."""

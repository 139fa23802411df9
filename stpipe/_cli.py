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


def _add_more_commands(sub) -> None:
    """Hook for ``bench`` and ``demo`` (defined below)."""


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

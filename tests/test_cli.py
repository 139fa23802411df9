"""The ``python -m stpipe`` command line."""
from __future__ import annotations

import subprocess
import sys

import pytest

from stpipe import _cli


def run_cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "stpipe", *args],
        capture_output=True, text=True, timeout=timeout,
    )


def test_info_prints_versions_cuda_planner_backends_and_memory():
    res = run_cli("info")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for key in ("python", "torch", "numpy", "cupy", "numba", "numba-cuda", "CUDA",
                "GPU", "planner", "backend", "pinnable", "estimate"):
        assert key in out, f"{key!r} missing from info output:\n{out}"
    import stpipe.planner
    assert f"planner     {stpipe.planner.implementation()}" in out


def test_info_does_not_import_cupy_or_numba_at_import_stpipe():
    code = ("import sys, stpipe, stpipe._cli; "
            "print([m for m in ('cupy', 'numba') if m in sys.modules])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_missing_package_reports_not_installed():
    assert _cli._module_version("stpipe_no_such_module_xyz", ("stpipe-no-such-dist",)) == "not installed"


def test_fmt_bytes():
    assert _cli.fmt_bytes(None) == "unknown"
    assert _cli.fmt_bytes(512) == "512 B"
    assert _cli.fmt_bytes(3 * 1024 ** 3) == "3.0 GiB"


def test_no_command_is_a_usage_error():
    res = run_cli()
    assert res.returncode == 2
    assert "usage:" in res.stderr


def test_unknown_command_is_a_usage_error():
    res = run_cli("frobnicate")
    assert res.returncode == 2
    assert "invalid choice" in res.stderr

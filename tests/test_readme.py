"""Every code block in README.md is run here.

``python`` blocks are executed as they are (in a subprocess, from a temporary folder).
``bash`` blocks: each ``python -m stpipe ...`` command runs (``demo`` with a small
``--max-tokens`` so the suite stays fast, ``bench`` with ``--quick``), each
``pip install -e ...`` line is checked to name an extra that ``pyproject.toml`` defines
(CI runs the install itself, from a fresh clone, exactly as written), and each
``python -m pytest ...`` line is checked to be the command CI runs.
"""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)


def _blocks(lang: str) -> list[str]:
    return [body for kind, body in _BLOCK.findall(README.read_text()) if kind == lang]


def _extras() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^(\w[\w-]*)\s*=", section, re.M))


def test_readme_has_code_blocks():
    assert _blocks("python"), "README.md has no python example"
    assert _blocks("bash"), "README.md has no set-up commands"


@pytest.mark.parametrize("index", range(len(_blocks("python"))), ids=lambda i: f"python-block-{i}")
def test_python_block_runs(index, tmp_path):
    code = _blocks("python")[index]
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"README python block {index} failed:\n{code}\n{proc.stderr[-3000:]}"


def _bash_commands() -> list[str]:
    cmds = []
    for body in _blocks("bash"):
        for line in body.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                cmds.extend(part.strip() for part in line.split("&&"))
    return cmds


def test_bash_commands_are_known_and_consistent():
    extras = _extras()
    cmds = _bash_commands()
    assert any(c == 'pip install -e ".[test]"' for c in cmds)
    assert "python -m pytest" in cmds
    assert "python -m stpipe demo" in cmds
    for c in cmds:
        if c.startswith("pip install"):
            for extra in re.findall(r"\[([\w,-]+)\]", c):
                assert set(extra.split(",")) <= extras, f"README installs unknown extra {extra!r}"
        else:
            assert c.startswith("python -m "), f"unexpected README command {c!r}"


_STPIPE = sorted({c for c in _bash_commands() if c.startswith("python -m stpipe")})


@pytest.mark.parametrize("cmd", _STPIPE)
def test_stpipe_commands_run(cmd, tmp_path):
    argv = shlex.split(cmd)[3:]
    if argv and argv[0] == "demo" and "--max-tokens" not in argv:
        argv += ["--max-tokens", "20000", "--buckets", "20000", "--min-count", "2", "--no-progress", "--device", "cpu"]
    if argv and argv[0] == "bench" and "--quick" not in argv:
        argv += ["--quick"]
    proc = subprocess.run([sys.executable, "-m", "stpipe", *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"

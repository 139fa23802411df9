"""The ``python -m stpipe`` command line."""
from __future__ import annotations

import os
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
    assert "launches    " in out and ("compiled" in out or "ctypes" in out)


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


def test_help_shows_zero_defaults():
    """A default of 0 is a default (argparse's formatter was skipped for falsy ones)."""
    res = run_cli("demo", "--help")
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    assert "seed of everything random (default: 0)" in text
    assert "sgd 0.01" in text


def test_unknown_command_is_a_usage_error():
    res = run_cli("frobnicate")
    assert res.returncode == 2
    assert "invalid choice" in res.stderr


# ------------------------------------------------------------------ argument errors

@pytest.mark.parametrize("args, message", [
    (["demo", "--dim", "0"], "expected a positive integer, got '0'"),
    (["demo", "--epochs", "two"], "expected a positive integer, got 'two'"),
    (["demo", "--optimizer", "rmsprop"], "invalid choice: 'rmsprop'"),
    (["demo", "--device", "tpu"], "invalid choice: 'tpu'"),
    (["demo", "--lr", "-1"], "expected a positive number"),
    (["demo", "--subsample", "nan"], "expected a number >= 0"),
    (["demo", "--max-tokens", "-5"], "expected an integer >= 0"),
    (["demo", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["bench", "--rows", "0"], "expected a positive integer"),
], ids=["dim0", "epochs-word", "optimizer", "device", "lr", "subsample", "max-tokens",
        "unknown-flag", "bench-rows"])
def test_bad_arguments_exit_2_with_argparse_message(capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        _cli.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m stpipe" in err and message in err


def _fail(capsys, args):
    rc = _cli.main(args)
    err = capsys.readouterr().err
    assert rc == 1, err
    return err


def test_missing_corpus_path_is_a_clear_error(capsys, tmp_path):
    err = _fail(capsys, ["demo", "--corpus", str(tmp_path / "nope"), "--no-progress"])
    assert "stpipe demo: error: corpus path" in err and "does not exist" in err


def test_empty_corpus_is_a_clear_error(capsys, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    err = _fail(capsys, ["demo", "--corpus", str(tmp_path / "empty.txt"), "--buckets", "10"])
    assert "holds no words" in err
    folder = tmp_path / "d"
    folder.mkdir()
    err = _fail(capsys, ["demo", "--corpus", str(folder), "--buckets", "10"])
    assert "no text files" in err


def test_too_little_memory_is_an_error_before_any_work(capsys, monkeypatch):
    monkeypatch.setattr(_cli, "available_ram", lambda: 8 << 30)
    import stpipe._corpus as corpus

    def must_not_read(*a, **k):
        raise AssertionError("the corpus was read before the memory check")

    monkeypatch.setattr(corpus, "read_corpus", must_not_read)
    err = _fail(capsys, ["demo", "--buckets", "100000000", "--dim", "128"])
    assert "needs about" in err and "available" in err and "--buckets" in err


def test_cuda_requested_without_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert "CUDA is not available" in _fail(capsys, ["demo", "--device", "cuda"])


def test_out_folder_must_exist(capsys, tmp_path):
    err = _fail(capsys, ["demo", "--out", str(tmp_path / "no" / "v.npz"), "--buckets", "10"])
    assert "does not exist" in err


def test_load_missing_file(capsys, tmp_path):
    assert "does not exist" in _fail(capsys, ["demo", "--load", str(tmp_path / "v.npz")])


# ------------------------------------------------------------------ demo end to end

def _small_corpus(tmp_path):
    from stpipe import _corpus

    folder = tmp_path / "corpus"
    folder.mkdir()
    root = _corpus.default_corpus_root()
    for name in ("socket.py", "threading.py", "queue.py", "selectors.py"):
        src = os.path.join(root, name)
        if os.path.exists(src):
            (folder / name).write_text(open(src, encoding="utf-8").read())
    return folder


def test_demo_trains_saves_and_reloads(capsys, tmp_path):
    out = tmp_path / "vectors.npz"
    rc = _cli.main(["demo", "--corpus", str(_small_corpus(tmp_path)), "--buckets", "5000",
                    "--min-count", "2", "--dim", "16", "--no-progress", "--out", str(out),
                    "--probe", "socket", "--probe", "zzzunknown", "--device", "cpu"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "tokens/s" in text and "nearest neighbours" in text
    assert "socket:" in text and "out of vocabulary" in text
    assert out.exists()
    assert _cli.main(["demo", "--load", str(out), "--probe", "socket", "--probe", "zzz"]) == 0
    text = capsys.readouterr().out
    assert "socket:" in text and "zzz: not in the vocabulary" in text


def test_out_folder_that_takes_no_file_is_refused_before_training(capsys, tmp_path, monkeypatch):
    """A folder where no file can be created (os.access says yes to root everywhere) is
    refused before training (regression: the save failed after it, with a traceback)."""
    import tempfile

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refuse)
    err = _fail(capsys, ["demo", "--out", str(tmp_path / "v.npz"), "--buckets", "10"])
    assert "cannot create a file" in err and "Permission denied" in err


def test_a_save_that_fails_after_training_keeps_the_vectors(capsys, tmp_path, monkeypatch):
    """The disk may fill or go during training: a failed save writes the vectors to a
    spare file in the temp folder, names it, and exits 1 (nothing trained is lost)."""
    from stpipe import _demo

    real, calls = _demo.save_vectors, []

    def save(path, *a, **k):
        calls.append(path)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real(path, *a, **k)

    monkeypatch.setattr(_demo, "save_vectors", save)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    out = tmp_path / "vectors.npz"
    rc = _cli.main(["demo", "--corpus", str(_small_corpus(tmp_path)), "--buckets", "500",
                    "--min-count", "2", "--dim", "8", "--no-progress", "--out", str(out),
                    "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 1 and "No space left" in err and len(calls) == 2
    spare = calls[1]
    assert spare.startswith(str(tmp_path)) and spare in err and os.path.exists(spare)
    assert not out.exists()
    assert _cli.main(["demo", "--load", spare, "--probe", "socket"]) == 0


def test_ctrl_c_stops_cleanly_and_saves_nothing(tmp_path):
    import signal
    import time

    out = tmp_path / "vectors.npz"
    out.write_bytes(b"previous file")
    proc = subprocess.Popen(
        [sys.executable, "-m", "stpipe", "demo", "--out", str(out), "--max-tokens", "600000",
         "--buckets", "200000", "--epochs", "20", "--no-progress", "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = ""
        deadline = time.time() + 90
        while "model:" not in line and time.time() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert "model:" in line, proc.stderr.read()
        time.sleep(3)  # inside training
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    assert rc == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert out.read_bytes() == b"previous file"
    assert sorted(os.listdir(tmp_path)) == ["vectors.npz"]


# --------------------------------------------------------------------------- bench

def test_bench_quick_prints_table_with_ratios(capsys):
    rc = _cli.main(["bench", "--quick", "--rows", "50000", "--batch", "2048", "--batch", "8192"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "x naive" in out and "x limit" in out
    assert "naive" in out and "stpipe-torch" in out and "limit" in out


def test_bench_plot_without_matplotlib_is_a_clear_error(capsys, tmp_path):
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:
        rc = _cli.main(["bench", "--quick", "--rows", "20000", "--batch", "1024",
                        "--plot", str(tmp_path / "b.png")])
        assert rc == 0 and (tmp_path / "b.png").exists()
        return
    err = _fail(capsys, ["bench", "--quick", "--plot", str(tmp_path / "b.png")])
    assert "matplotlib" in err

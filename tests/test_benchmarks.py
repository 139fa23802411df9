"""The benchmark scripts' own logic (CPU): how train_skipgram.py combines rounds and how
compat_speedtorch.py runs its DataGadget rows in rounds."""
import importlib.util
import os

import pytest
import torch

_BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def _load(script):
    """A benchmark script as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_{script}_under_test", os.path.join(_BENCH, f"{script}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ts():
    return _load("train_skipgram")


def _row(steps_per_s, **kw):
    return {"steps_per_s": steps_per_s, "ms_per_step": 1e3 / steps_per_s, "host_rss_gb": 1.0,
            "note": "n", **kw}


def test_median(ts):
    """Rows are medians over their rounds: the middle one, or the mean of the middle two."""
    def ms(*per_round):
        rounds = [{"stpipe_depth1": _row(1e3 / m)} for m in per_round]
        return ts._combine_rounds(rounds)["stpipe_depth1"]["ms_per_step"]

    assert ms(3.0, 1.0, 2.0) == pytest.approx(2.0)
    assert ms(4.0, 1.0) == pytest.approx(2.5)
    assert ms(7.0) == pytest.approx(7.0)


def test_round_orders():
    from stpipe._bench import _round_orders

    assert _round_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    assert _round_orders(["a"], 1) == [["a"]]


def test_combine_rounds_ratios_are_medians_of_same_round_ratios(ts):
    # the machine doubles its speed between rounds: per-round ratios 0.9 and 1.05
    rounds = [
        {"gpu_sparse_adam": _row(100.0), "stpipe_depth1": _row(90.0), "speedtorch_adam": _row(30.0)},
        {"speedtorch_adam": _row(70.0), "stpipe_depth1": _row(210.0), "gpu_sparse_adam": _row(200.0)},
    ]
    out = ts._combine_rounds(rounds)
    d1 = out["stpipe_depth1"]
    assert d1["rounds"] == 2
    assert d1["rounds_ratio_to_ceiling"] == pytest.approx([0.9, 1.05])
    assert d1["ratio_to_ceiling"] == pytest.approx(0.975)
    # a ratio of medians would say 150 / 150 = 1.0 instead
    assert d1["rounds_ratio_to_speedtorch_adam"] == pytest.approx([3.0, 3.0])
    assert d1["ratio_to_speedtorch_adam"] == pytest.approx(3.0)
    assert d1["ms_per_step"] == pytest.approx((1e3 / 90 + 1e3 / 210) / 2)
    assert d1["steps_per_s"] == pytest.approx(1e3 / d1["ms_per_step"])
    assert d1["note"] == "n" and d1["host_rss_gb"] == 1.0
    # the baselines get no ratio to themselves; the ceiling's ratio to SpeedTorch is not asked for
    assert "ratio_to_ceiling" not in out["gpu_sparse_adam"]
    assert "ratio_to_speedtorch_adam" not in out["gpu_sparse_adam"]
    assert out["speedtorch_adam"]["ratio_to_ceiling"] == pytest.approx(0.325)


def test_combine_rounds_skips_failed_rounds_and_keeps_errors(ts):
    rounds = [
        {"gpu_sparse_adam": _row(100.0), "stpipe_depth0": {"error": "boom"}, "compat_adam": {"error": "e1"}},
        {"gpu_sparse_adam": _row(100.0), "stpipe_depth0": _row(80.0), "compat_adam": {"error": "e2"}},
    ]
    out = ts._combine_rounds(rounds)
    assert out["stpipe_depth0"]["rounds"] == 1
    assert out["stpipe_depth0"]["rounds_ratio_to_ceiling"] == pytest.approx([0.8])
    assert out["compat_adam"] == {"error": "e1"}
    assert list(out) == ["gpu_sparse_adam", "stpipe_depth0", "compat_adam"]


def test_rounds_needs_isolate(ts):
    with pytest.raises(SystemExit) as exc:
        ts.main(["--quick", "--rounds", "2"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        ts.main(["--quick", "--isolate", "--rounds", "0"])


@pytest.fixture(scope="module")
def cs():
    return _load("compat_speedtorch")


def test_gadget_rows_run_in_rounds(cs, monkeypatch):
    """compat_speedtorch.py's DataGadget rows: every configuration once per round, the
    order reversed in the next round, each row its fastest round with every round kept,
    and the CuPy-id rows compared with SpeedTorch's."""
    import sys
    import types

    import torch

    events = []
    speed = {}  # (impl, CPUPinn, round) -> seconds per call

    def module(name):
        class DataGadget:
            def __init__(self, path, CPUPinn=False):
                self.key = (name, CPUPinn)
                events.append(self.key)
                self.round = (len(events) - 1) // 6  # six configurations per round

            def gadgetInit(self):
                pass

            def getData(self, ids):
                now[0] += speed[self.key + (self.round,)]

            insertData = lambda self, rows, ids: self.getData(ids)  # noqa: E731

        return types.SimpleNamespace(DataGadget=DataGadget)

    now = [0.0]  # a fake clock: each call advances it by its configured time
    monkeypatch.setattr(cs.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(cs.torch, "randn", lambda *a, **k: torch.zeros(a))
    monkeypatch.setattr(cs, "_free", lambda: None)
    monkeypatch.setattr(cs, "_sync", lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(asarray=lambda x: x))
    monkeypatch.setattr(cs.importlib.util, "find_spec", lambda name: object())
    impls = {"stpipe": module("stpipe"), "SpeedTorch": module("SpeedTorch")}
    for impl in ("stpipe", "SpeedTorch"):
        for pin in (True, False):
            speed[(impl, pin, 0)] = 0.002
            speed[(impl, pin, 1)] = 0.001 if impl == "stpipe" else 0.004
    gb = 8 * 4 * 4 / 1e9
    out = cs.bench_gadget(impls, "unused.npy", rows=100, dim=4, batch=8, repeats=3, rounds=2)
    names = [(g["impl"], g["CPUPinn"]) for g in out]
    assert names == [("stpipe", True), ("stpipe", False), ("stpipe (CuPy ids)", True),
                     ("stpipe (CuPy ids)", False), ("SpeedTorch", True), ("SpeedTorch", False)]
    first, second = events[:6], events[6:]
    assert len(events) == 12 and second == first[::-1]
    st = next(g for g in out if g["impl"] == "SpeedTorch" and g["CPUPinn"])
    ours = next(g for g in out if g["impl"] == "stpipe (CuPy ids)" and g["CPUPinn"])
    assert st["getData_rounds"] == pytest.approx([gb / 0.002, gb / 0.004])
    assert st["getData_GBps"] == pytest.approx(gb / 0.002)  # its fastest round
    assert st["getData_ms"] == pytest.approx(2.0) and ours["insertData_ms"] == pytest.approx(1.0)
    assert ours["insertData_GBps"] == pytest.approx(gb / 0.001)
    md = cs._markdown({"info": {"date": "d", "gpu": "g", "cpus": 2, "torch": "t", "cupy": "c", "rows": 100,
                                "dim": 4, "command": "x", "batch": 8}, "gadget": out, "train": []})
    assert "(2.00x)" in md and md.count("x) [") == 4  # only the CuPy-id rows get a ratio


def test_timed_drain_covers_the_wait_after_the_last_step(ts):
    """``drain_ms`` runs from the end of the last step's Python to the end of its work:
    here the last loss read, made to take 50 ms (as a GPU backlog would)."""
    import time

    import torch

    class SlowLoss:
        def detach(self):
            return self

        def __float__(self):
            time.sleep(0.05)
            return 1.0

    res = ts.timed(torch.device("cpu"), 1, list(range(4)), lambda b: SlowLoss())
    assert res["steps"] == 3
    assert 50.0 <= res["drain_ms"] <= res["seconds"] * 1e3
    quick = ts.timed(torch.device("cpu"), 1, list(range(4)), lambda b: torch.tensor(float(b)))
    assert 0.0 <= quick["drain_ms"] < 50.0


def test_interleave_times_paired_blocks(ts, tmp_path):
    """``--interleave N``: every method times ceil(steps / N) blocks of N steps in one
    process, and a ratio is the median of the per-block ratios (not a ratio of medians)."""
    import json
    import statistics

    assert ts.main(["--quick", "--interleave", "5", "--methods",
                    "gpu_sparse_adam,stpipe_depth1,stpipe_depth0,compute_only", "--out", str(tmp_path)]) == 0
    res = json.load(open(tmp_path / "train_skipgram.json"))
    assert res["info"]["interleave"] == 5
    rows = res["results"]
    assert list(rows) == ["gpu_sparse_adam", "stpipe_depth1", "stpipe_depth0", "compute_only"]
    base = rows["gpu_sparse_adam"]["blocks_ms_per_step"]
    assert len(base) == 4  # --quick: 20 timed steps
    for name in ("stpipe_depth1", "stpipe_depth0", "compute_only"):
        r = rows[name]
        assert r["steps"] == 20 and r["interleave"] == 5 and len(r["blocks_ms_per_step"]) == 4
        ratios = [b / t for b, t in zip(base, r["blocks_ms_per_step"])]
        assert r["blocks_ratio_to_ceiling"] == pytest.approx(ratios, rel=1e-3)
        assert r["ratio_to_ceiling"] == pytest.approx(statistics.median(ratios), rel=1e-3)
        assert r["blocks_faster_than_ceiling"] == sum(x >= 1.0 for x in ratios)
        assert r["ms_per_step"] == pytest.approx(statistics.median(r["blocks_ms_per_step"]), rel=1e-3)
    assert rows["gpu_sparse_adam"]["ratio_to_ceiling"] == pytest.approx(1.0)
    assert "blocks_ratio_to_ceiling" not in rows["gpu_sparse_adam"]


@pytest.mark.parametrize("argv, code", [
    (["--interleave", "-1"], 2),
    (["--interleave", "5", "--isolate"], 2),
])
def test_interleave_bad_arguments(ts, argv, code):
    with pytest.raises(SystemExit) as exc:
        ts.main(["--quick", *argv])
    assert exc.value.code == code


def test_interleave_rejects_methods_it_cannot_run(ts, tmp_path):
    with pytest.raises(SystemExit, match="--interleave runs gpu_sparse_adam, .*; got naive_host, profile"):
        ts.main(["--quick", "--interleave", "5", "--methods", "gpu_sparse_adam,naive_host,profile",
                 "--out", str(tmp_path)])


def test_interleave_ratios_to_speedtorch_are_per_block(ts, tmp_path, monkeypatch):
    """The SpeedTorch rows take part in the rounds; the compat and stpipe rows get their
    ratio to SpeedTorch as the median of per-block ratios. SpeedTorch itself is not
    installed here, so its row runs the compat layer's code under SpeedTorch's name."""
    import json
    import statistics

    real = ts._speedtorch_step
    made = []

    def fake(args, dev, adam, compat, fused=False):
        made.append((adam, compat))
        return real(args, dev, adam, True, fused)
    monkeypatch.setattr(ts, "_speedtorch_step", fake)
    assert ts.main(["--quick", "--interleave", "10", "--methods", "speedtorch_adam,compat_adam,stpipe_depth0",
                    "--out", str(tmp_path)]) == 0
    assert made == [(True, False), (True, True)]
    rows = json.load(open(tmp_path / "train_skipgram.json"))["results"]
    base = rows["speedtorch_adam"]["blocks_ms_per_step"]
    assert len(base) == 2
    assert "ratio_to_speedtorch_adam" not in rows["speedtorch_adam"]
    assert "ratio_to_ceiling" not in rows["compat_adam"]  # no ceiling ran
    for name in ("compat_adam", "stpipe_depth0"):
        ratios = [b / t for b, t in zip(base, rows[name]["blocks_ms_per_step"])]
        assert rows[name]["ratio_to_speedtorch_adam"] == pytest.approx(statistics.median(ratios), rel=1e-3)
        assert rows[name]["blocks_faster_than_speedtorch_adam"] == sum(x >= 1.0 for x in ratios)
    assert rows["compat_adam"]["note"].startswith("stpipe.compat.speedtorch")


def test_interleave_fused_rows_run_fused_adam_against_fused_speedtorch(ts, tmp_path, monkeypatch):
    """The fused-Adam rows: ``speedtorch_adam_fused`` builds SpeedTorch's pattern with
    ``Adam(fused=True)``, ``stpipe_depth1_fused`` and ``compute_only_fused`` step fused Adam
    too, and the stpipe row's ratio to the fused SpeedTorch row is per block."""
    import json
    import statistics

    real = ts._speedtorch_step
    made, opts = [], []

    def fake(args, dev, adam, compat, fused=False):
        made.append((adam, compat, fused))
        return real(args, dev, adam, True, fused)  # SpeedTorch is not installed here
    monkeypatch.setattr(ts, "_speedtorch_step", fake)
    real_adam = torch.optim.Adam

    def adam(params, **kw):
        opts.append(kw.get("fused"))
        return real_adam(params, **kw)
    monkeypatch.setattr(torch.optim, "Adam", adam)
    assert ts.main(["--quick", "--interleave", "10", "--methods",
                    "speedtorch_adam_fused,stpipe_depth1_fused,compute_only_fused", "--out", str(tmp_path)]) == 0
    assert made == [(True, False, True)]  # Adam, SpeedTorch itself, fused
    assert opts == [True, True, True]  # SpeedTorch's, compute_only's and stpipe's Adam
    rows = json.load(open(tmp_path / "train_skipgram.json"))["results"]
    assert "Adam(fused=True)" in rows["speedtorch_adam_fused"]["note"]
    base = rows["speedtorch_adam_fused"]["blocks_ms_per_step"]
    ratios = [b / t for b, t in zip(base, rows["stpipe_depth1_fused"]["blocks_ms_per_step"])]
    assert rows["stpipe_depth1_fused"]["ratio_to_speedtorch_adam_fused"] == pytest.approx(
        statistics.median(ratios), rel=1e-3)
    assert "ratio_to_speedtorch_adam" not in rows["stpipe_depth1_fused"]  # that row did not run
    assert "ratio_to_speedtorch_adam_fused" not in rows["compute_only_fused"]


def test_speedtorch_note_names_fused_adam(ts):
    assert "Adam(fused=True)" in ts._speedtorch_note(True, False, True)
    assert "fused" not in ts._speedtorch_note(True, False)


def test_interleave_reports_a_speedtorch_that_cannot_run(ts, tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(ts, "_speedtorch_step", lambda args, dev, adam, compat, fused=False: {"skipped": "no SpeedTorch"})
    assert ts.main(["--quick", "--interleave", "10", "--methods", "speedtorch_sgd,stpipe_depth0",
                    "--out", str(tmp_path)]) == 0
    rows = json.load(open(tmp_path / "train_skipgram.json"))["results"]
    assert rows["speedtorch_sgd"] == {"skipped": "no SpeedTorch"}
    assert len(rows["stpipe_depth0"]["blocks_ms_per_step"]) == 2
    assert "ratio_to_speedtorch_sgd" not in rows["stpipe_depth0"]


def test_parse_variant(ts):
    assert ts.parse_variant("f4=_auto_fraction:0.4") == ("f4", {"_auto_fraction": 0.4})
    assert ts.parse_variant("x=_inv32:False, _pair:True,prefetch_delay:'auto'") == (
        "x", {"_inv32": False, "_pair": True, "prefetch_delay": "auto"})
    assert ts.variant_row("f4") == "stpipe_depth1[f4]"


@pytest.mark.parametrize("spec, message", [
    ("f4", "expected NAME=ATTR:VALUE"),
    ("f4=_auto_fraction", "expected ATTR:VALUE, got '_auto_fraction'"),
    ("f4=1x:0.4", "expected ATTR:VALUE, got '1x:0.4'"),
    ("f4=_auto_fraction:zero", "must be a Python literal"),
])
def test_parse_variant_says_what_it_expected(ts, spec, message):
    with pytest.raises(ValueError, match=message):
        ts.parse_variant(spec)


@pytest.mark.parametrize("argv", [
    ["--variant", "f4=_auto_fraction:0.4"],  # no --interleave
    ["--interleave", "5", "--variant", "f4=_auto_fraction"],
    ["--interleave", "5", "--variant", "f4=_auto_fraction:0.4", "--variant", "f4=_inv32:False"],  # one name twice
])
def test_variant_bad_arguments(ts, argv):
    with pytest.raises(SystemExit) as exc:
        ts.main(["--quick", *argv])
    assert exc.value.code == 2


def test_variant_of_an_attribute_the_pipeline_lacks(ts, tmp_path):
    with pytest.raises(SystemExit, match="--variant typo: Pipeline has no attribute '_auto_fractoin'"):
        ts.main(["--quick", "--interleave", "5", "--methods", "stpipe_depth1",
                 "--variant", "typo=_auto_fractoin:0.4", "--out", str(tmp_path)])


def test_interleave_variant_rows_are_paired_with_depth1(ts, tmp_path, monkeypatch):
    """``--variant``: a depth-1 row over the same tables, its pipeline's attributes set,
    timed in the same rounds, with its per-block difference to ``stpipe_depth1``."""
    import json
    import statistics

    made = []
    real = ts._Stpipe.pipeline

    def spy(self, depth, **kw):
        pipe = real(self, depth, **kw)
        made.append((self, pipe))
        return pipe
    monkeypatch.setattr(ts._Stpipe, "pipeline", spy)
    assert ts.main(["--quick", "--interleave", "5", "--methods", "gpu_sparse_adam,stpipe_depth1",
                    "--variant", "f4=_auto_fraction:0.4", "--variant", "i64=_inv32:False,_pair:False",
                    "--out", str(tmp_path)]) == 0
    assert len(made) == 3 and len({id(st) for st, _ in made}) == 1  # one pair of tables
    plain, f4, i64 = (p for _, p in made)
    assert plain._auto_fraction == 0.3 and plain._inv32 and plain._pair
    assert f4._auto_fraction == 0.4 and f4._inv32
    assert i64._inv32 is False and i64._pair is False and i64._auto_fraction == 0.3
    rows = json.load(open(tmp_path / "train_skipgram.json"))["results"]
    assert list(rows) == ["gpu_sparse_adam", "stpipe_depth1", "stpipe_depth1[f4]", "stpipe_depth1[i64]"]
    base = rows["stpipe_depth1"]["blocks_ms_per_step"]
    for name, attrs in (("f4", {"_auto_fraction": "0.4"}), ("i64", {"_inv32": "False", "_pair": "False"})):
        r = rows[f"stpipe_depth1[{name}]"]
        assert r["variant"] == attrs
        assert len(r["blocks_ms_per_step"]) == 4 and "ratio_to_ceiling" in r
        d = [b - a for a, b in zip(base, r["blocks_ms_per_step"])]
        got = r["minus_stpipe_depth1"]
        assert got["median_ms"] == pytest.approx(statistics.median(d), abs=2e-3)
        assert got["mean_ms"] == pytest.approx(statistics.mean(d), abs=2e-3)
        assert got["blocks_faster"] == sum(x < 0 for x in d) and got["blocks"] == 4
    assert "minus_stpipe_depth1" not in rows["stpipe_depth1"]


def test_parts_accounts_both_threads_and_the_phases(ts, tmp_path):
    """``parts``: each pipeline part's CPU and wall time per step by thread, the user's
    step by phase beside the step alone's, and the wrappers gone afterwards."""
    import json

    import stpipe.pipeline as P

    before = {name: getattr(P.Pipeline, name) for name in ("_enter", "_exit", "_issue", "_write_back")}
    plan_before = P._plan
    assert ts.main(["--quick", "--methods", "parts", "--out", str(tmp_path)]) == 0
    assert {name: getattr(P.Pipeline, name) for name in before} == before  # unpatched
    assert P._plan is plan_before
    r = json.load(open(tmp_path / "train_skipgram.json"))["results"]["stpipe_depth1_parts"]
    assert r["steps"] == 20
    parts = r["parts_us_per_step"]
    for key in ("training:_enter", "training:_exit", "training:_write_back"):
        assert parts[key]["calls"] == 1.0, key  # once per timed step
    assert parts["prefetch:_issue"]["calls"] > 0.5 and parts["prefetch:_prepare"]["calls"] > 0.5
    assert not any(k.startswith("training:_issue") for k in parts)  # depth 1: the prefetch thread issues
    # nested parts lie inside their callers
    assert parts["training:_write_back"]["wall"] <= parts["training:_exit"]["wall"]
    assert parts["prefetch:_gather"]["wall"] <= parts["prefetch:_issue"]["wall"]
    ph = r["phases_us"]
    assert set(ph["depth1"]) == {"loop", "entry", "forward", "backward", "opt_step", "zero_grad", "exit"}
    assert set(ph["step_alone"]) == {"loop", "forward", "backward", "opt_step", "zero_grad"}
    assert ph["depth1_minus_step_alone"]["backward"] == pytest.approx(
        ph["depth1"]["backward"] - ph["step_alone"]["backward"], abs=0.2)
    assert 0 <= ph["issue_start_us"] <= ph["issue_end_us"]
    log = open(tmp_path / "train_skipgram.log").read()
    assert "stpipe depth 1 by phase" in log and "training:_exit" in log

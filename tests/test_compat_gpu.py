"""GPU tests of stpipe.compat.speedtorch, and a side-by-side check against SpeedTorch 0.1.6.

Every test is marked ``gpu`` (skipped without CUDA). The side-by-side tests also need the
SpeedTorch wheel (and CuPy, which it imports); they skip cleanly where it is missing.
SpeedTorch's optimizer switchers fail on current PyTorch, so the side-by-side training runs
plain SGD (model switchers only), on duplicate-free batches (where SpeedTorch is right).

The device-parametrised tests of ``test_compat_speedtorch.py`` (the skip-gram pattern for
every optimizer, against the row-restricted oracle) run on CUDA in the same session.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import stpipe.compat.speedtorch as SpeedTorch
from test_compat_speedtorch import (SkipGram, _force_fusing, _pattern_step, _pattern_tables, _pinned_pattern,
                                    assert_same, make_batches, oracle, run_pattern)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpeedTorch.CupyFallbackWarning)
        yield


@pytest.fixture(params=["kernels", "torch-ops"])
def last_wins(request, monkeypatch):
    """GPU-resident insertData both ways: the CuPy last-wins kernels (which also range-check
    GPU ids) and their torch-op twin."""
    if request.param == "torch-ops":
        monkeypatch.setattr(SpeedTorch, "_last_wins", lambda: None)
    elif SpeedTorch._last_wins() is None:
        pytest.skip("CuPy's kernels do not load here")
    return request.param


@pytest.fixture
def speedtorch():
    """The original package (needs CuPy)."""
    return pytest.importorskip("SpeedTorch")


# ---------------------------------------------------------------------------------------
# stpipe alone
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("cpupinn", [False, True])
def test_no_device_wide_sync_per_swap(monkeypatch, cpupinn):
    """Swaps order themselves with streams/events; torch.cuda.synchronize is never called."""
    model = SkipGram(8, 8 * 5, 16).cuda()
    us = SpeedTorch.ModelFactory(model.u_embeddings, 1000, 16, CPUPinn=cpupinn)
    vs = SpeedTorch.ModelFactory(model.v_embeddings, 2000, 16, CPUPinn=cpupinn)
    us.uniformDistributionInit(-0.1, 0.1)
    vs.uniformDistributionInit(-0.1, 0.1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    uo = SpeedTorch.OptimizerFactory(opt, 1000, 16, model, "u_embeddings", CPUPinn=cpupinn)
    vo = SpeedTorch.OptimizerFactory(opt, 2000, 16, model, "v_embeddings", CPUPinn=cpupinn)
    uo.optInit()
    vo.optInit()
    ud = torch.as_tensor(us.variableTransformer(8, 1), device="cuda")
    pd, nd = (torch.as_tensor(a, device="cuda") for a in vs.variableTransformer(8, 1, 4))
    rng = np.random.default_rng(0)

    def boom(*a, **k):
        raise AssertionError("torch.cuda.synchronize() called during a swap")

    monkeypatch.setattr(torch.cuda, "synchronize", boom)
    for _ in range(5):
        u = rng.integers(0, 1000, (8, 1))
        v, n = rng.integers(0, 50, (8, 1)), rng.integers(0, 2000, (8, 4))
        for s, a in ((us, (u,)), (vs, (v, n)), (uo, (u,)), (vo, (v, n))):
            s.beforeForwardPass(*a)
        loss = model(ud, pd, nd)
        opt.zero_grad()
        loss.backward()
        opt.step()
        for s, a in ((us, (u,)), (vs, (v, n)), (uo, (u,)), (vo, (v, n))):
            s.afterOptimizerStep(*a)
    monkeypatch.undo()
    assert np.isfinite(vs.getNumpyVersion()).all()


@pytest.mark.parametrize("cpupinn", [False, True])
def test_rows_go_to_the_model_device(cpupinn):
    gpu_emb = torch.nn.Embedding(3, 4).cuda()
    mf = SpeedTorch.ModelFactory(gpu_emb, 100, 4, CPUPinn=cpupinn)
    mf.uniformDistributionInit(-1, 1)
    mf.beforeForwardPass(np.array([1, 50, 99]))
    assert gpu_emb.weight.device.type == "cuda"
    if cpupinn:
        assert mf._store.table.pinned and mf._store.table.device.type == "cuda"
    else:
        assert mf._store.device.type == "cuda"           # SpeedTorch's GPU-resident table
    cpu_emb = torch.nn.Embedding(3, 4)
    mf2 = SpeedTorch.ModelFactory(cpu_emb, 100, 4, CPUPinn=cpupinn)
    mf2.uniformDistributionInit(-1, 1)
    mf2.beforeForwardPass(np.array([1, 50, 99]))
    assert cpu_emb.weight.device.type == "cpu"
    np.testing.assert_array_equal(cpu_emb.weight.detach().numpy(), mf2.getNumpyVersion()[[1, 50, 99]])


@pytest.mark.parametrize("kind", ["ModelFactory", "ModelFactory-pinned", "Pytorch-cuda", "Pytorch-cpu-pinned"])
@pytest.mark.parametrize("opt_name", ["Adam", "Adagrad", "Rprop", "ASGD", "RMSprop"])
def test_pattern_gpu_every_placement(kind, opt_name):
    got = run_pattern("cuda", opt_name, kind=kind, dups=True, steps=6, n_u=500, n_v=800)
    want = oracle("cuda", opt_name, got["init_u"], got["init_v"], got["batches"])
    assert_same(got, want)


@pytest.mark.parametrize("cpupinn", [False, True])
def test_datagadget_on_cuda(tmp_path, cpupinn):
    data = np.random.default_rng(0).standard_normal((1000, 32)).astype(np.float32)
    np.save(tmp_path / "d.npy", data)
    g = SpeedTorch.DataGadget(str(tmp_path / "d.npy"), CPUPinn=cpupinn)
    g.gadgetInit()
    idx = np.random.default_rng(1).integers(0, 1000, 300)
    got = g.getData(idx)
    assert got.is_cuda
    np.testing.assert_array_equal(got.cpu().numpy(), data[idx])
    rows = torch.randn(300, 32, device="cuda")
    uniq = np.random.default_rng(2).permutation(1000)[:300]
    g.insertData(rows, uniq)
    data[uniq] = rows.cpu().numpy()
    np.testing.assert_array_equal(g.getNumpyVersion(), data)


@pytest.mark.parametrize("cpupinn", [False, True], ids=["gpu-table", "pinned-table"])
@pytest.mark.parametrize("dim", [32, 4], ids=["stamps", "narrow-rows-sort"])
def test_datagadget_gpu_insert_repeats_last_wins(tmp_path, dim, last_wins, cpupinn):
    """insertData with repeated numpy ids, several calls: each id keeps its last
    occurrence (the numpy result), whichever path decides it (GPU table: stamps kernels
    or torch ops; pinned table: the GPU sort and UVA write)."""
    rng = np.random.default_rng(3)
    data = rng.standard_normal((500, dim)).astype(np.float32)
    np.save(tmp_path / "d.npy", data)
    g = SpeedTorch.DataGadget(str(tmp_path / "d.npy"), CPUPinn=cpupinn)
    g.gadgetInit()
    if not cpupinn:
        assert g._store.checks_in_kernel() == (last_wins == "kernels")
    for call in range(4):
        ids = rng.integers(0, 60, 400)  # many repeats
        rows = torch.randn(400, dim, device="cuda")
        g.insertData(rows, ids)
        data[ids] = rows.cpu().numpy()  # numpy: the last occurrence wins
        np.testing.assert_array_equal(g.getNumpyVersion(), data)
    with pytest.raises(IndexError):
        g.insertData(torch.zeros(2, dim, device="cuda"), np.array([1, 500]))
    np.testing.assert_array_equal(g.getNumpyVersion(), data)


@pytest.mark.parametrize("kind", ["torch", "cupy"])
@pytest.mark.parametrize("cpupinn", [False, True])
def test_datagadget_takes_gpu_ids(tmp_path, cpupinn, kind, last_wins):
    """SpeedTorch code indexes its DataGadget with CuPy arrays: ids on the GPU (CuPy or a
    CUDA tensor) work on both placements, repeats keep their last occurrence, and bad
    ids raise before anything moves."""
    if kind == "cupy":
        cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(4)
    data = rng.standard_normal((700, 32)).astype(np.float32)
    np.save(tmp_path / "d.npy", data)
    g = SpeedTorch.DataGadget(str(tmp_path / "d.npy"), CPUPinn=cpupinn)
    g.gadgetInit()

    def on_gpu(a):
        return cupy.asarray(a) if kind == "cupy" else torch.as_tensor(a, device="cuda")

    idx = rng.integers(0, 700, (20, 6))
    got = g.getData(on_gpu(idx))
    assert got.is_cuda and tuple(got.shape) == (20, 6, 32)
    np.testing.assert_array_equal(got.cpu().numpy(), data[idx])
    for _ in range(3):
        ids = rng.integers(0, 50, 300)  # repeats: the last occurrence wins
        rows = torch.randn(300, 32, device="cuda")
        g.insertData(rows, on_gpu(ids))
        data[ids] = rows.cpu().numpy()
        np.testing.assert_array_equal(g.getNumpyVersion(), data)
    with pytest.raises(IndexError, match="row id 700 at position 2"):
        g.insertData(torch.zeros(3, 32, device="cuda"), on_gpu(np.array([0, 5, 700])))
    with pytest.raises(IndexError, match="row id -1 at position 1"):
        g.getData(on_gpu(np.array([3, -1])))
    with pytest.raises(TypeError):
        g.getData(torch.tensor([1.0, 2.0], device="cuda"))
    np.testing.assert_array_equal(g.getNumpyVersion(), data)


# ---------------------------------------------------------------------------------------
# side by side with SpeedTorch 0.1.6 (duplicate-free batches)
# ---------------------------------------------------------------------------------------
def _train_sgd(st_mod, table_u, table_v, tmp_path, tag, cpupinn, batches, B, P, N, dim, pytorch=False):
    """The speedtorch-api.md loop with SGD, through `st_mod`'s model switchers."""
    torch.manual_seed(0)
    model = SkipGram(B, B * (P + N), dim).cuda()
    np.save(tmp_path / f"{tag}_u.npy", table_u)
    np.save(tmp_path / f"{tag}_v.npy", table_v)
    if pytorch:
        us = st_mod.PytorchModelFactory(model.u_embeddings, table_u.shape[0], dim)
        vs = st_mod.PytorchModelFactory(model.v_embeddings, table_v.shape[0], dim)
        torch.save(torch.from_numpy(table_u).cuda(), tmp_path / f"{tag}_u.pt")
        torch.save(torch.from_numpy(table_v).cuda(), tmp_path / f"{tag}_v.pt")
        us.loadTorch(str(tmp_path / f"{tag}_u.pt"))
        vs.loadTorch(str(tmp_path / f"{tag}_v.pt"))
    else:
        us = st_mod.ModelFactory(model.u_embeddings, table_u.shape[0], dim, CPUPinn=cpupinn)
        vs = st_mod.ModelFactory(model.v_embeddings, table_v.shape[0], dim, CPUPinn=cpupinn)
        us.loadCupy(str(tmp_path / f"{tag}_u.npy"))
        vs.loadCupy(str(tmp_path / f"{tag}_v.npy"))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ud = torch.as_tensor(us.variableTransformer(B, 1), device="cuda")
    pd, nd = (torch.as_tensor(a, device="cuda") for a in vs.variableTransformer(B, P, N))
    losses, weights = [], []
    for u, v, n in batches:
        us.beforeForwardPass(u)
        vs.beforeForwardPass(v, n)
        weights.append(model.v_embeddings.weight.detach().cpu().numpy().copy())
        loss = model(ud, pd, nd)
        opt.zero_grad()
        loss.backward()
        opt.step()
        us.afterOptimizerStep(u)
        vs.afterOptimizerStep(v, n)
        losses.append(float(loss.detach()))
    torch.cuda.synchronize()
    return losses, weights, us.getNumpyVersion(), (vs.getNumpyVersion() if not pytorch else vs.getNumpyVersion())


@pytest.mark.parametrize("variant", ["ModelFactory", "ModelFactory-pinned", "PytorchModelFactory"])
def test_side_by_side_with_speedtorch(speedtorch, tmp_path, variant):
    rng = np.random.default_rng(0)
    B, P, N, dim = 16, 2, 5, 32
    table_u = rng.uniform(-0.5, 0.5, (3000, dim)).astype(np.float32)
    table_v = rng.uniform(-0.5, 0.5, (5000, dim)).astype(np.float32)
    batches = make_batches(rng, 8, B, P, N, 3000, 5000, dups=False)
    kw = dict(cpupinn=variant.endswith("pinned"), batches=batches, B=B, P=P, N=N, dim=dim,
              pytorch=variant == "PytorchModelFactory")
    ref = _train_sgd(speedtorch, table_u, table_v, tmp_path, "st", **kw)
    got = _train_sgd(SpeedTorch, table_u, table_v, tmp_path, "sp", **kw)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6, atol=1e-6)        # losses
    for a, b in zip(got[1], ref[1]):                                         # gathered rows
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(got[2], ref[2], rtol=1e-6, atol=1e-7)         # written back
    np.testing.assert_allclose(got[3], ref[3], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cpupinn", [False, True])
def test_datagadget_side_by_side_and_files_readable_by_both(speedtorch, tmp_path, cpupinn):
    import cupy

    rng = np.random.default_rng(0)
    data = rng.standard_normal((4000, 64)).astype(np.float32)
    np.save(tmp_path / "d.npy", data)
    theirs = speedtorch.DataGadget(str(tmp_path / "d.npy"), CPUPinn=cpupinn)
    ours = SpeedTorch.DataGadget(str(tmp_path / "d.npy"), CPUPinn=cpupinn)
    theirs.gadgetInit()
    ours.gadgetInit()
    idx = rng.permutation(4000)[:1000]
    a = theirs.getData(cupy.asarray(idx))
    b = ours.getData(idx)
    torch.testing.assert_close(b, a, rtol=0, atol=0)
    rows = torch.randn(1000, 64, device="cuda")
    theirs.insertData(rows, cupy.asarray(idx))
    ours.insertData(rows, idx)
    np.testing.assert_array_equal(ours.getNumpyVersion(), theirs.getNumpyVersion())
    ours.saveCupy(str(tmp_path / "ours"))
    theirs.saveCupy(str(tmp_path / "theirs"))
    theirs.loadCupy(str(tmp_path / "ours.npy"))      # SpeedTorch reads stpipe's file
    ours.loadCupy(str(tmp_path / "theirs.npy"))      # and stpipe reads SpeedTorch's
    np.testing.assert_array_equal(ours.getNumpyVersion(), theirs.getNumpyVersion())


@pytest.mark.parametrize("dups", [False, True], ids=["distinct", "dups"])
@pytest.mark.parametrize("reader", ["fused", "getNumpyVersion", "beforeForwardPass", "optimizer-first"])
def test_weight_write_back_waits_for_the_state_and_every_reader_sees_it(reader, dups):
    """Pinned tables with CuPy: the model switcher's write-back is left for the optimizer
    switcher's, which writes weight and state rows in one launch; a read of the table in
    between (getNumpyVersion, the next beforeForwardPass) writes the weight first, and the
    other call order writes each as before. Every table ends as the step left it."""
    dev, n, dim, B = "cuda", 50, 8, 6
    model = SkipGram(B, B, dim).to(dev)
    mf = SpeedTorch.ModelFactory(model.u_embeddings, n, dim, CPUPinn=True)
    mf.uniformDistributionInit(-1, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    of = SpeedTorch.OptimizerFactory(opt, n, dim, model, "u_embeddings", CPUPinn=True)
    of.optInit()
    ids = np.array([3, 7, 3, 9, 20, 7] if dups else [3, 7, 1, 9, 20, 11])
    mf.beforeForwardPass(ids)
    of.beforeForwardPass(ids)
    w = model.u_embeddings.weight
    (model.u_embeddings(torch.arange(B, device=dev)) ** 2).sum().backward()
    opt.step()
    rows = w.detach().cpu().numpy().copy()  # unique ids ascending (dups) or one per position
    order = np.unique(ids) if dups else ids
    state = {k: v.detach().cpu().numpy().copy() for k, v in opt.state[w].items() if v.dim() == 2}
    if reader == "optimizer-first":
        of.afterOptimizerStep(ids)
        mf.afterOptimizerStep(ids)
        assert mf._pending is None
    else:
        mf.afterOptimizerStep(ids)
        assert mf._pending is not None  # deferred: the fused path is taken
        if reader == "getNumpyVersion":
            np.testing.assert_array_equal(mf.getNumpyVersion()[order], rows)
            assert mf._pending is None
        elif reader == "beforeForwardPass":
            mf.beforeForwardPass(ids)  # reads the table: the rows the step wrote
            np.testing.assert_array_equal(w.detach().cpu().numpy(), rows)
            assert mf._pending is None
        of.afterOptimizerStep(ids)
        assert mf._pending is None
    np.testing.assert_array_equal(mf.getNumpyVersion()[order], rows)
    tables = of.getNumpyVersion()
    for key, want in state.items():
        np.testing.assert_array_equal(tables[key][order], want)


def _moves_loop(steps=12, B=64, P=4, N=8, n_u=3000, n_v=5000, dim=16, device="cuda"):
    """The Adam skip-gram pattern with pinned tables on random Zipf-like batches; returns
    every table and the losses."""
    model, sw, opt, osw, dummies = _pinned_pattern(
        device, lambda ps: torch.optim.Adam(ps, lr=0.05), B, P, N, n_u, n_v, dim)
    rng = np.random.default_rng(3)
    losses = []
    for _ in range(steps):
        u = rng.zipf(1.3, B) % n_u
        pos, neg = rng.zipf(1.3, (B, P)) % n_v, rng.integers(0, n_v, (B, N))
        loss = _pattern_step(model, sw, opt, osw, dummies, u, pos, neg)
        losses.append(float(loss.detach()))
    return {"losses": np.array(losses), **_pattern_tables(sw, osw)}


def test_fused_moves_are_prepared_once_per_buffer(monkeypatch):
    """The model switchers launch their fused gathers and write-backs directly, from
    launches prepared once per plane buffer (the caching allocator hands the same blocks
    back step after step), without going through ``gather_many``/``scatter_many``; the
    tables end bit-identical to moving each table alone."""
    from stpipe import host

    prepared, launched, many = [], [], []
    real_prepare, real_call = host._prepare_move, host._PreparedMove.__call__

    def prepare(op, tables, planes):
        prepared.append((op, planes.data_ptr(), planes.shape[0], planes.stride(0), *map(id, tables)))
        return real_prepare(op, tables, planes)

    monkeypatch.setattr(host, "_prepare_move", prepare)
    monkeypatch.setattr(host._PreparedMove, "__call__",
                        lambda self, *a: launched.append(self.write) or real_call(self, *a))
    for name in ("gather_many", "scatter_many"):
        real = getattr(host, name)
        monkeypatch.setattr(host, name, lambda *a, _r=real, **k: many.append(1) or _r(*a, **k))
    monkeypatch.setattr(SpeedTorch._Moves, "MAX", 10_000)  # no clearing: repeats would show
    steps = 12
    fused = _moves_loop(steps, dim=128)
    if not launched:
        pytest.skip("CuPy's fused kernels do not load here")
    # every step: a gather and a write-back for u and for v (batches with duplicates)
    assert len(launched) == 4 * steps and sum(launched) == 2 * steps
    assert many == []  # all launched directly
    assert 0 < len(prepared) == len(set(prepared))  # each buffer geometry prepared once
    monkeypatch.undo()
    _force_fusing(monkeypatch, False)
    plain = _moves_loop(steps, dim=128)
    assert fused.keys() == plain.keys()
    for key in plain:
        np.testing.assert_array_equal(fused[key], plain[key], err_msg=key)


@pytest.mark.parametrize("fused", [False, True])
def test_bench_speedtorch_step_fix_on_cuda(fused):
    """The benchmarks' fix of SpeedTorch 0.1.6's int ``step`` on CUDA parameters: foreach
    Adam keeps ``step`` on the CPU, fused Adam on the parameter's device (it refuses a CPU
    one); either way the fixed state steps like Adam's own."""
    from stpipe._bench import _speedtorch_step_fix

    kw = {"fused": True} if fused else {}
    p = torch.nn.Parameter(torch.zeros(3, 2, device="cuda"))
    opt = torch.optim.Adam([p], lr=0.1, **kw)
    opt.state[p].update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
    _speedtorch_step_fix(opt)
    step = opt.state[p]["step"]
    assert step.dtype == torch.float32
    assert step.device == (p.device if fused else torch.device("cpu"))
    ref = torch.nn.Parameter(torch.zeros(3, 2, device="cuda"))
    ref_opt = torch.optim.Adam([ref], lr=0.1, **kw)
    for i in range(3):
        g = torch.full((3, 2), float(i + 1), device="cuda")
        p.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    assert float(opt.state[p]["step"]) == 3.0
    assert torch.equal(p.detach(), ref.detach())

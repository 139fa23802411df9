"""Tests of stpipe.compat.speedtorch, the SpeedTorch 0.1.6 API.

The skip-gram training pattern of speedtorch-api.md runs through the switchers and is
checked against an oracle that never uses them: the same model on full-size
``nn.Embedding`` tables fed the real ids, whose optimizer is applied to the touched rows
only (a "carrier" parameter loaded with those rows and their state each step). That is
the documented semantics: gradients of duplicate ids summed (nn.Embedding's backward),
one update per unique row, untouched rows and their state unchanged. Plain SGD is also
checked against dense SGD on the full table (exact), and Adam against
``nn.Embedding(sparse=True)`` + ``SparseAdam``.

Tolerances: float32; SGD agrees to 1e-6, the others to rtol 1e-4 / atol 1e-6 (different
kernels — foreach vs single tensor, sparse vs dense — round differently).

Every test that takes ``device`` also runs on CUDA (marked ``gpu``; skipped without it).
"""
from __future__ import annotations

import inspect
import os
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import stpipe.compat.speedtorch as SpeedTorch
from stpipe import StpipeError

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
ATOL, RTOL = 1e-6, 1e-4


# ---------------------------------------------------------------------------------------
# the model of the usage pattern, and the oracle
# ---------------------------------------------------------------------------------------
class SkipGram(torch.nn.Module):
    """The skip-gram model SpeedTorch's examples train (negative sampling)."""

    def __init__(self, n_u: int, n_v: int, dim: int, sparse: bool = False) -> None:
        super().__init__()
        self.u_embeddings = torch.nn.Embedding(n_u, dim, sparse=sparse)
        self.v_embeddings = torch.nn.Embedding(n_v, dim, sparse=sparse)

    def forward(self, pos_u, pos_v, neg_v):
        emb_u = self.u_embeddings(pos_u)                      # (B, 1, d)
        emb_v = self.v_embeddings(pos_v)                      # (B, P, d)
        emb_n = self.v_embeddings(neg_v)                      # (B, N, d)
        score = F.logsigmoid((emb_u * emb_v).sum(-1)).sum()
        neg = F.logsigmoid(-torch.bmm(emb_n, emb_u.transpose(1, 2))).sum()
        return -(score + neg) / pos_u.shape[0]


OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.5),
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.05),
    # SparseAdam adds eps before the bias correction, Adam after it (eps / sqrt(1 - b2^t)
    # vs eps): with a tiny eps both are negligible and the two agree to float rounding.
    "Adam-tiny-eps": lambda p: torch.optim.Adam(p, lr=0.05, eps=1e-12),
    "Adam-amsgrad": lambda p: torch.optim.Adam(p, lr=0.05, amsgrad=True),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.05),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.3),
    "Adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.05, t0=2),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
    "RMSprop-centered-momentum": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.05),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.05),
}


class RowOracle:
    """One full table trained with ``make_opt`` restricted to the rows a batch touches."""

    def __init__(self, weight: torch.Tensor, make_opt) -> None:
        self.weight = weight.clone()
        self.carrier = torch.nn.Parameter(torch.zeros(1, weight.shape[1], device=weight.device))
        self.opt = make_opt([self.carrier])
        self.state: dict = {}  # key -> full (num_rows, dim) state table
        for key, value in self.opt.state[self.carrier].items():  # eager init (Adagrad)
            if isinstance(value, torch.Tensor) and value.shape == self.carrier.shape:
                self.state[key] = torch.full_like(self.weight, float(value.flatten()[0]))

    def step(self, ids: np.ndarray, grad_full: torch.Tensor) -> None:
        rows = torch.from_numpy(np.unique(ids)).to(self.weight.device)
        st = self.opt.state[self.carrier]
        for key, table in self.state.items():
            st[key] = table[rows].clone()
        self.carrier.data = self.weight[rows].clone()
        self.carrier.grad = grad_full[rows].clone()
        self.opt.step()
        self.weight[rows] = self.carrier.data
        for key, value in st.items():
            if isinstance(value, torch.Tensor) and value.shape == self.carrier.shape:
                if key not in self.state:  # first step: the optimizer created it
                    init = value.new_zeros(self.weight.shape)
                    if key == "sum":
                        init.fill_(self.opt.defaults["initial_accumulator_value"])
                    if key == "step_size":
                        init.fill_(self.opt.defaults["lr"])
                    self.state[key] = init
                self.state[key][rows] = value

    def reset_rows_state(self) -> None:
        """Every state table back to initial values (what optInit gives)."""
        for key, t in self.state.items():
            fill = {"sum": self.opt.defaults.get("initial_accumulator_value", 0.0),
                    "step_size": self.opt.defaults.get("lr", 0.0)}.get(key, 0.0)
            t.fill_(fill)


def make_batches(rng, steps, B, P, N, n_u, n_v, dups):
    out = []
    for _ in range(steps):
        if dups:
            u = rng.integers(0, 6, size=(B, 1))              # few ids: many repeats
            v = rng.integers(0, 10, size=(B, P))
            neg = rng.integers(0, 10, size=(B, N))
            v[0, 0] = neg[0, 0]                                # at least one repeat
            u[0, 0] = u[1, 0]
        else:
            u = rng.permutation(n_u)[:B].reshape(B, 1)
            vv = rng.permutation(n_v)[: B * (P + N)]
            v, neg = vv[: B * P].reshape(B, P), vv[B * P:].reshape(B, N)
        out.append((u, v, neg))
    return out


def factories(kind, emb, n, dim, device):
    """A model switcher of the given flavour for ``emb``."""
    if kind == "ModelFactory":
        return SpeedTorch.ModelFactory(emb, n, dim)
    if kind == "ModelFactory-pinned":
        return SpeedTorch.ModelFactory(emb, n, dim, CPUPinn=True)
    if kind == "Pytorch-cuda":
        return SpeedTorch.PytorchModelFactory(emb, n, dim, deviceType="cuda" if device == "cuda" else "cpu")
    return SpeedTorch.PytorchModelFactory(emb, n, dim, deviceType="cpu", pinType=True)


def opt_factory(kind, opt, n, dim, model, name):
    if kind.startswith("ModelFactory"):
        return SpeedTorch.OptimizerFactory(opt, n, dim, model, name, CPUPinn=kind.endswith("pinned"))
    if kind == "Pytorch-cuda":
        return SpeedTorch.PytorchOptimizerFactory(opt, n, dim, model, name,
                                                  deviceType="cuda" if str(model.u_embeddings.weight.device) != "cpu" else "cpu")
    return SpeedTorch.PytorchOptimizerFactory(opt, n, dim, model, name, deviceType="cpu", pinType=True)


@pytest.fixture(autouse=True)
def _quiet_fallback():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpeedTorch.CupyFallbackWarning)
        yield


def run_pattern(device, opt_name, kind="ModelFactory", dups=False, steps=5, seed=0,
                B=4, P=2, N=3, n_u=40, n_v=60, dim=8, with_opt_switch=True):
    """The speedtorch-api.md loop; returns (losses, u table, v table, switchers...)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = SkipGram(B, B * (P + N), dim).to(device)
    u_switch = factories(kind, model.u_embeddings, n_u, dim, device)
    v_switch = factories(kind, model.v_embeddings, n_v, dim, device)
    u_switch.uniformDistributionInit(-0.5, 0.5)
    v_switch.uniformDistributionInit(-0.5, 0.5)
    init_u, init_v = u_switch.getNumpyVersion(), v_switch.getNumpyVersion()
    opt = OPTIMIZERS[opt_name](model.parameters())
    if with_opt_switch:
        u_opt = opt_factory(kind, opt, n_u, dim, model, "u_embeddings")
        v_opt = opt_factory(kind, opt, n_v, dim, model, "v_embeddings")
        u_opt.optInit()
        v_opt.optInit()
    u_dummy = torch.as_tensor(u_switch.variableTransformer(B, 1), device=device)
    pd, nd = v_switch.variableTransformer(B, P, N)
    pos_dummy, neg_dummy = torch.as_tensor(pd, device=device), torch.as_tensor(nd, device=device)
    batches = make_batches(rng, steps, B, P, N, n_u, n_v, dups)
    losses = []
    for u, v, neg in batches:
        u_switch.beforeForwardPass(u)
        v_switch.beforeForwardPass(v, neg)
        if with_opt_switch:
            u_opt.beforeForwardPass(u)
            v_opt.beforeForwardPass(v, neg)
        loss = model(u_dummy, pos_dummy, neg_dummy)
        opt.zero_grad()
        loss.backward()
        opt.step()
        u_switch.afterOptimizerStep(u)
        v_switch.afterOptimizerStep(v, neg)
        if with_opt_switch:
            u_opt.afterOptimizerStep(u)
            v_opt.afterOptimizerStep(v, neg)
        losses.append(float(loss.detach()))
    return dict(losses=losses, u=u_switch.getNumpyVersion(), v=v_switch.getNumpyVersion(),
                init_u=init_u, init_v=init_v, batches=batches, opt=opt, model=model,
                u_switch=u_switch, v_switch=v_switch)


def oracle(device, opt_name, init_u, init_v, batches, dim=8):
    """The same training on full tables with the optimizer restricted to touched rows."""
    ref = SkipGram(init_u.shape[0], init_v.shape[0], dim).to(device)
    with torch.no_grad():
        ref.u_embeddings.weight.copy_(torch.from_numpy(init_u))
        ref.v_embeddings.weight.copy_(torch.from_numpy(init_v))
    ou = RowOracle(ref.u_embeddings.weight.detach(), OPTIMIZERS[opt_name])
    ov = RowOracle(ref.v_embeddings.weight.detach(), OPTIMIZERS[opt_name])
    losses = []
    for u, v, neg in batches:
        t = lambda a: torch.as_tensor(a, device=device)  # noqa: E731
        with torch.no_grad():
            ref.u_embeddings.weight.copy_(ou.weight)
            ref.v_embeddings.weight.copy_(ov.weight)
        ref.zero_grad()
        loss = ref(t(u), t(v), t(neg))
        loss.backward()
        ou.step(u.reshape(-1), ref.u_embeddings.weight.grad)
        ov.step(np.concatenate([v.reshape(-1), neg.reshape(-1)]), ref.v_embeddings.weight.grad)
        losses.append(float(loss.detach()))
    return dict(losses=losses, u=ou.weight.cpu().numpy(), v=ov.weight.cpu().numpy(), ou=ou, ov=ov)


def assert_same(got, want, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=rtol, atol=atol)
    np.testing.assert_allclose(got["u"], want["u"], rtol=rtol, atol=atol)
    np.testing.assert_allclose(got["v"], want["v"], rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------
# the training pattern
# ---------------------------------------------------------------------------------------
KINDS = ["ModelFactory", "ModelFactory-pinned", "Pytorch-cuda", "Pytorch-cpu-pinned"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dups", [False, True], ids=["unique", "duplicates"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_pattern_matches_row_restricted_optimizer(device, opt_name, dups):
    got = run_pattern(device, opt_name, dups=dups)
    want = oracle(device, opt_name, got["init_u"], got["init_v"], got["batches"])
    assert_same(got, want)
    # rows never touched are exactly their initial values
    touched_v = np.unique(np.concatenate([np.concatenate([v.ravel(), n.ravel()]) for _, v, n in got["batches"]]))
    untouched = np.setdiff1d(np.arange(got["v"].shape[0]), touched_v)
    np.testing.assert_array_equal(got["v"][untouched], got["init_v"][untouched])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dups", [False, True], ids=["unique", "duplicates"])
def test_pattern_every_placement(device, kind, dups):
    got = run_pattern(device, "Adam", kind=kind, dups=dups)
    want = oracle(device, "Adam", got["init_u"], got["init_v"], got["batches"])
    assert_same(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dups", [False, True], ids=["unique", "duplicates"])
def test_sgd_matches_dense_full_table_exactly(device, dups):
    got = run_pattern(device, "SGD", dups=dups, with_opt_switch=False, steps=6)
    ref = SkipGram(40, 60, 8).to(device)
    with torch.no_grad():
        ref.u_embeddings.weight.copy_(torch.from_numpy(got["init_u"]))
        ref.v_embeddings.weight.copy_(torch.from_numpy(got["init_v"]))
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    losses = []
    for u, v, neg in got["batches"]:
        t = lambda a: torch.as_tensor(a, device=device)  # noqa: E731
        loss = ref(t(u), t(v), t(neg))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert_same(got, dict(losses=losses, u=ref.u_embeddings.weight.detach().cpu().numpy(),
                          v=ref.v_embeddings.weight.detach().cpu().numpy()), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dups", [False, True], ids=["unique", "duplicates"])
def test_adam_matches_sparse_embedding_with_sparseadam(device, dups):
    got = run_pattern(device, "Adam-tiny-eps", dups=dups, steps=6)
    ref = SkipGram(40, 60, 8, sparse=True).to(device)
    with torch.no_grad():
        ref.u_embeddings.weight.copy_(torch.from_numpy(got["init_u"]))
        ref.v_embeddings.weight.copy_(torch.from_numpy(got["init_v"]))
    opt = torch.optim.SparseAdam(list(ref.parameters()), lr=0.05, eps=1e-12)
    losses = []
    for u, v, neg in got["batches"]:
        t = lambda a: torch.as_tensor(a, device=device)  # noqa: E731
        loss = ref(t(u), t(v), t(neg))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert_same(got, dict(losses=losses, u=ref.u_embeddings.weight.detach().cpu().numpy(),
                          v=ref.v_embeddings.weight.detach().cpu().numpy()), atol=2e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_sparseadam_through_the_switchers(device):
    """SparseAdam needs sparse gradients: the model's embeddings are built sparse=True."""
    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    model = SkipGram(4, 20, 8, sparse=True).to(device)
    us = SpeedTorch.ModelFactory(model.u_embeddings, 40, 8)
    vs = SpeedTorch.ModelFactory(model.v_embeddings, 60, 8)
    us.normalDistributionInit(0, 0.3)
    vs.normalDistributionInit(0, 0.3)
    init_u, init_v = us.getNumpyVersion(), vs.getNumpyVersion()
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.05, eps=1e-12)
    uo = SpeedTorch.OptimizerFactory(opt, 40, 8, model, "u_embeddings")
    vo = SpeedTorch.OptimizerFactory(opt, 60, 8, model, "v_embeddings")
    uo.optInit()
    vo.optInit()
    ud = torch.as_tensor(us.variableTransformer(4, 1), device=device)
    pd, nd = (torch.as_tensor(a, device=device) for a in vs.variableTransformer(4, 2, 3))
    batches = make_batches(rng, 5, 4, 2, 3, 40, 60, dups=True)
    losses = []
    for u, v, n in batches:
        for s, a in ((us, (u,)), (vs, (v, n)), (uo, (u,)), (vo, (v, n))):
            s.beforeForwardPass(*a)
        loss = model(ud, pd, nd)
        opt.zero_grad()
        loss.backward()
        opt.step()
        for s, a in ((us, (u,)), (vs, (v, n)), (uo, (u,)), (vo, (v, n))):
            s.afterOptimizerStep(*a)
        losses.append(float(loss.detach()))
    want = oracle(device, "Adam-tiny-eps", init_u, init_v, batches)  # see OPTIMIZERS
    assert_same(dict(losses=losses, u=us.getNumpyVersion(), v=vs.getNumpyVersion()), want,
                atol=2e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_rprop_switched_after_its_first_step_as_documented(device):
    """SpeedTorch's documented order: one forward/backward/step, then the switcher."""
    torch.manual_seed(0)
    rng = np.random.default_rng(3)
    model = SkipGram(4, 20, 8).to(device)
    us = SpeedTorch.ModelFactory(model.u_embeddings, 40, 8)
    vs = SpeedTorch.ModelFactory(model.v_embeddings, 60, 8)
    us.uniformDistributionInit(-0.5, 0.5)
    vs.uniformDistributionInit(-0.5, 0.5)
    init_u, init_v = us.getNumpyVersion(), vs.getNumpyVersion()
    opt = OPTIMIZERS["Rprop"](model.parameters())
    ud = torch.as_tensor(us.variableTransformer(4, 1), device=device)
    pd, nd = (torch.as_tensor(a, device=device) for a in vs.variableTransformer(4, 2, 3))
    batches = make_batches(rng, 5, 4, 2, 3, 40, 60, dups=True)
    switches = [(us, 0), (vs, 1)]
    losses = []
    for i, (u, v, n) in enumerate(batches):
        if i == 1:
            assert len(opt.state[model.u_embeddings.weight]) > 0   # state exists now
            uo = SpeedTorch.OptimizerFactory(opt, 40, 8, model, "u_embeddings")
            vo = SpeedTorch.OptimizerFactory(opt, 60, 8, model, "v_embeddings")
            uo.optInit()
            vo.optInit()
            switches += [(uo, 0), (vo, 1)]
        args = [(u,), (v, n)]
        for s, j in switches:
            s.beforeForwardPass(*args[j])
        loss = model(ud, pd, nd)
        opt.zero_grad()
        loss.backward()
        opt.step()
        for s, j in switches:
            s.afterOptimizerStep(*args[j])
        losses.append(float(loss.detach()))
    # oracle: as documented, the first step's per-row state is dropped by optInit()
    ref = oracle(device, "Rprop", init_u, init_v, batches[:1])
    ou, ov = ref["ou"], ref["ov"]
    ou.reset_rows_state()
    ov.reset_rows_state()
    full = SkipGram(40, 60, 8).to(device)
    for u, v, n in batches[1:]:
        t = lambda a: torch.as_tensor(a, device=device)  # noqa: E731
        with torch.no_grad():
            full.u_embeddings.weight.copy_(ou.weight)
            full.v_embeddings.weight.copy_(ov.weight)
        full.zero_grad()
        loss = full(t(u), t(v), t(n))
        loss.backward()
        ou.step(u.reshape(-1), full.u_embeddings.weight.grad)
        ov.step(np.concatenate([v.ravel(), n.ravel()]), full.v_embeddings.weight.grad)
        ref["losses"].append(float(loss.detach()))
    assert_same(dict(losses=losses, u=us.getNumpyVersion(), v=vs.getNumpyVersion()),
                dict(losses=ref["losses"], u=ou.weight.cpu().numpy(), v=ov.weight.cpu().numpy()))


@pytest.mark.parametrize("opt_name,expect", [
    ("Adagrad", {"sum": 0.3}),
    ("Rprop", {"prev": 0.0, "step_size": 0.01}),
    ("Adam", {"exp_avg": 0.0, "exp_avg_sq": 0.0}),
    ("Adam-amsgrad", {"exp_avg": 0.0, "exp_avg_sq": 0.0, "max_exp_avg_sq": 0.0}),
    ("RMSprop-centered-momentum", {"square_avg": 0.0, "momentum_buffer": 0.0, "grad_avg": 0.0}),
    ("ASGD", {"ax": 0.0}),
    ("Adadelta", {"square_avg": 0.0, "acc_delta": 0.0}),
    ("Adamax", {"exp_avg": 0.0, "exp_inf": 0.0}),
    ("SGD", {}),
])
def test_opt_init_gives_initial_state_values(opt_name, expect):
    model = SkipGram(4, 20, 8)
    opt = OPTIMIZERS[opt_name](model.parameters())
    of = SpeedTorch.OptimizerFactory(opt, 50, 8, model, "v_embeddings")
    of.optInit()
    assert of.optVarList == list(expect)
    tables = of.getNumpyVersion()
    for key, value in expect.items():
        assert tables[key].shape == (50, 8)
        np.testing.assert_array_equal(tables[key], np.float32(value))


FP16_STATE_OPTIMIZERS = ["Adam", "Adam-amsgrad", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad",
                         "RMSprop", "SGD-momentum"]


@pytest.mark.parametrize("cpupinn", [False, True])
@pytest.mark.parametrize("opt_name", FP16_STATE_OPTIMIZERS)
def test_float16_state_tables_for_a_float32_model(opt_name, cpupinn):
    """OptimizerFactory(dtype='float16') with a float32 model: the state rows are
    installed in the parameter's dtype (regression: float16 rows made Adam's and Adamax's
    ``step`` raise "expected dtype c10::Half"), the tables stay float16, and training
    agrees with float32 state tables within float16 rounding.

    Tolerance: float16 keeps 11 significant bits (unit roundoff u = 2**-11 ~ 4.9e-4) and
    each step rounds every state row it writes back once, so after S steps the weights
    and the state agree to rtol = 4 * S * u (~1.2e-2 for S = 6), with atol 1e-5 for
    values near 0. Gradients are O(1) here, so the second moments stay well above
    float16's underflow (6e-8), where the state would be lost rather than rounded.
    """
    steps, n, B, D = 6, 20, 6, 4

    def run(state_dtype):
        torch.manual_seed(0)
        rng = np.random.default_rng(0)
        emb = torch.nn.Embedding(B, D)
        model = torch.nn.ModuleDict({"u": emb})
        ms = SpeedTorch.ModelFactory(emb, n, D, CPUPinn=cpupinn)
        ms.uniformDistributionInit(-1, 1)
        opt = OPTIMIZERS[opt_name](model.parameters())
        osw = SpeedTorch.OptimizerFactory(opt, n, D, model, "u", dtype=state_dtype, CPUPinn=cpupinn)
        osw.optInit()
        target, dummy = torch.randn(B, D) * 2, torch.arange(B)
        for _ in range(steps):
            ids = rng.integers(0, 8, B)  # rows come back: their state is read again
            ms.beforeForwardPass(ids)
            osw.beforeForwardPass(ids)
            installed = [opt.state[emb.weight][k] for k in osw.optVarList if k in opt.state[emb.weight]]
            assert installed and all(t.dtype == torch.float32 for t in installed)
            loss = ((emb(dummy) - target) ** 2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ms.afterOptimizerStep(ids)
            osw.afterOptimizerStep(ids)
        tables = osw.getNumpyVersion()
        want = np.float16 if state_dtype == "float16" else np.float32
        assert all(t.dtype == want for t in tables.values())
        assert emb.weight.dtype == torch.float32
        return dict(weight=ms.getNumpyVersion(), **tables)

    half, full = run("float16"), run("float32")
    rtol = 4 * steps * 2.0 ** -11
    assert half.keys() == full.keys()
    for key in full:
        np.testing.assert_allclose(half[key].astype(np.float32), full[key], rtol=rtol, atol=1e-5,
                                   err_msg=key)


def test_scalar_state_stays_per_parameter():
    got = run_pattern("cpu", "ASGD", steps=3)
    st = got["opt"].state[got["model"].v_embeddings.weight]
    assert float(st["step"]) == 3
    assert st["eta"].dim() == 0 and st["mu"].dim() == 0
    assert st["ax"].shape == got["model"].v_embeddings.weight.shape
    got = run_pattern("cpu", "Adam", steps=4)
    assert float(got["opt"].state[got["model"].u_embeddings.weight]["step"]) == 4


# ---------------------------------------------------------------------------------------
# layout: SpeedTorch's rows for duplicate-free batches, dedup + remap otherwise
# ---------------------------------------------------------------------------------------
def test_variable_transformer():
    emb = torch.nn.Embedding(2, 3)
    mf = SpeedTorch.ModelFactory(emb, 10, 3)
    one = mf.variableTransformer(3, 2)
    assert one.shape == (3, 2) and one.ravel().tolist() == list(range(6))
    pos, neg = mf.variableTransformer(3, 2, 4)
    assert pos.shape == (3, 2) and neg.shape == (3, 4)
    assert np.concatenate([pos.ravel(), neg.ravel()]).tolist() == list(range(18))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_duplicate_free_batch_gives_speedtorch_rows(device, kind):
    emb = torch.nn.Embedding(5, 4).to(device)
    mf = factories(kind, emb, 30, 4, device)
    mf.normalDistributionInit(0.0, 1.0)
    table = mf.getNumpyVersion()
    pos, neg = np.array([[17, 3]]), np.array([[29, 0, 11]])
    mf.beforeForwardPass(pos, neg)
    ids = [17, 3, 29, 0, 11]
    assert emb.weight.device.type == torch.device(device).type
    np.testing.assert_array_equal(emb.weight.detach().cpu().numpy(), table[ids])
    with torch.no_grad():
        emb.weight.mul_(2)
    mf.afterOptimizerStep(pos, neg)
    after = mf.getNumpyVersion()
    np.testing.assert_array_equal(after[ids], 2 * table[ids])
    rest = np.setdiff1d(np.arange(30), ids)
    np.testing.assert_array_equal(after[rest], table[rest])


@pytest.mark.parametrize("device", DEVICES)
def test_duplicates_hold_unique_rows_and_remap_dummies(device):
    emb = torch.nn.Embedding(7, 4).to(device)
    mf = SpeedTorch.ModelFactory(emb, 30, 4)
    mf.uniformDistributionInit(-1, 1)
    table = mf.getNumpyVersion()
    pos, neg = np.array([[9, 4]]), np.array([[9, 21, 4, 4, 2]])
    mf.beforeForwardPass(pos, neg)
    assert emb.weight.shape == (4, 4)                       # 2, 4, 9, 21
    np.testing.assert_array_equal(emb.weight.detach().cpu().numpy(), table[[2, 4, 9, 21]])
    pd, nd = mf.variableTransformer(1, 2, 5)
    out_p = emb(torch.as_tensor(pd, device=device))
    out_n = emb(torch.as_tensor(nd, device=device))
    np.testing.assert_array_equal(out_p.detach().cpu().numpy()[0], table[[9, 4]])
    np.testing.assert_array_equal(out_n.detach().cpu().numpy()[0], table[[9, 21, 4, 4, 2]])
    # gradients of duplicates sum: d/dW of sum(emb(x)) counts occurrences
    (out_p.sum() + out_n.sum()).backward()
    counts = emb.weight.grad[:, 0].cpu().tolist()
    assert counts == [1.0, 3.0, 2.0, 1.0]
    with torch.no_grad():
        emb.weight.add_(torch.arange(4, device=device, dtype=torch.float32)[:, None])
    mf.afterOptimizerStep(pos, neg)
    after = mf.getNumpyVersion()
    np.testing.assert_array_equal(after[[2, 4, 9, 21]], table[[2, 4, 9, 21]] + np.arange(4, dtype=np.float32)[:, None])
    # a duplicate-free batch afterwards: no remapping any more
    mf.beforeForwardPass(np.array([[5, 6]]))
    x = torch.as_tensor([[0, 1]], device=device)
    np.testing.assert_array_equal(emb(x).detach().cpu().numpy()[0], after[[5, 6]])


def test_dedup_false_keeps_speedtorch_layout_last_occurrence_wins():
    emb = torch.nn.Embedding(4, 2)
    mf = SpeedTorch.ModelFactory(emb, 10, 2, dedup=False)
    mf.zerosInit()
    ids = np.array([3, 5, 3, 7])
    mf.beforeForwardPass(ids)
    assert emb.weight.shape == (4, 2)
    with torch.no_grad():
        emb.weight.copy_(torch.arange(8, dtype=torch.float32).view(4, 2))
    mf.afterOptimizerStep(ids)
    t = mf.getNumpyVersion()
    np.testing.assert_array_equal(t[3], [4, 5])            # position 2, the last 3
    np.testing.assert_array_equal(t[5], [2, 3])
    np.testing.assert_array_equal(t[7], [6, 7])


def test_after_step_with_other_ids_raises():
    emb = torch.nn.Embedding(4, 2)
    mf = SpeedTorch.ModelFactory(emb, 10, 2)
    mf.zerosInit()
    mf.beforeForwardPass(np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="afterOptimizerStep"):
        mf.afterOptimizerStep(np.array([1, 2, 3, 4]))


# ---------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", [-1, 30, 10**12])
def test_bad_ids_raise_index_error_and_move_nothing(kind, bad):
    emb = torch.nn.Embedding(3, 4)
    mf = factories(kind, emb, 30, 4, "cpu")
    mf.uniformDistributionInit(-1, 1)
    before = mf.getNumpyVersion()
    w0 = emb.weight.detach().clone()
    with pytest.raises(IndexError, match=str(bad)) as info:
        mf.beforeForwardPass(np.array([[1, 2]]), np.array([[4, bad]]))
    assert isinstance(info.value, StpipeError)
    assert "retrievedNegIndexes" in str(info.value)
    assert torch.equal(emb.weight.detach(), w0)
    with pytest.raises(IndexError):
        mf.afterOptimizerStep(np.array([bad, 1, 2]))
    np.testing.assert_array_equal(mf.getNumpyVersion(), before)


def test_bad_ids_in_optimizer_switch_and_float_ids():
    model = SkipGram(4, 8, 4)
    opt = torch.optim.Adam(model.parameters())
    of = SpeedTorch.OptimizerFactory(opt, 20, 4, model, "v_embeddings")
    of.optInit()
    with pytest.raises(IndexError):
        of.beforeForwardPass(np.array([0, 20]))
    mf = SpeedTorch.ModelFactory(model.u_embeddings, 20, 4)
    mf.zerosInit()
    with pytest.raises(TypeError):
        mf.beforeForwardPass(np.array([0.0, 1.0]))


def test_constructor_errors():
    model = SkipGram(4, 8, 4)
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match="u_embeddings"):
        SpeedTorch.OptimizerFactory(opt, 20, 4, model, "nope")
    with pytest.raises(ValueError, match="not supported"):
        SpeedTorch.OptimizerFactory(torch.optim.LBFGS(model.parameters()), 20, 4, model, "u_embeddings")
    other = torch.optim.Adam(model.v_embeddings.parameters())
    with pytest.raises(ValueError, match="not among"):
        SpeedTorch.OptimizerFactory(other, 20, 4, model, "u_embeddings")
    with pytest.raises(TypeError):
        SpeedTorch.ModelFactory(torch.zeros(3, 4), 20, 4)
    with pytest.raises(TypeError):
        SpeedTorch.ModelFactory(model.u_embeddings, 20, 4, datatype="int8")
    with pytest.raises(ValueError):
        SpeedTorch.ModelFactory(model.u_embeddings, 0, 4)
    mf = SpeedTorch.ModelFactory(model.u_embeddings, 20, 4)
    with pytest.raises(RuntimeError, match="zerosInit"):
        mf.beforeForwardPass(np.array([1]))
    of = SpeedTorch.OptimizerFactory(opt, 20, 4, model, "u_embeddings")
    with pytest.raises(RuntimeError, match="optInit"):
        of.beforeForwardPass(np.array([1]))


# ---------------------------------------------------------------------------------------
# dtypes, files, API surface
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("datatype,want", [("float32", torch.float32), ("float16", torch.float16),
                                           (torch.float16, torch.float16), (torch.float, torch.float32)])
@pytest.mark.parametrize("cpupinn", [False, True])
def test_datatype_strings_and_torch_dtypes(datatype, want, cpupinn):
    emb = torch.nn.Embedding(3, 4).to(want)
    mf = SpeedTorch.ModelFactory(emb, 10, 4, datatype=datatype, CPUPinn=cpupinn)
    mf.uniformDistributionInit(-1, 1)
    mf.beforeForwardPass(np.array([1, 2]))
    assert emb.weight.dtype == want
    assert mf.getNumpyVersion().dtype == torch.empty(0, dtype=want).numpy().dtype
    pf = SpeedTorch.PytorchModelFactory(emb, 10, 4, datatype=datatype, deviceType="cpu")
    pf.zerosInit()
    assert pf.getNumpyVersion().dtype == torch.empty(0, dtype=want).numpy().dtype


@pytest.mark.parametrize("cpupinn", [False, True])
def test_save_load_cupy_npy_roundtrip(tmp_path, cpupinn):
    emb = torch.nn.Embedding(3, 4)
    mf = SpeedTorch.ModelFactory(emb, 25, 4, CPUPinn=cpupinn)
    mf.uniformDistributionInit(-1, 1)
    table = mf.getNumpyVersion()
    mf.saveCupy(str(tmp_path / "u"))                       # np.save naming: .npy appended
    assert sorted(os.listdir(tmp_path)) == ["u.npy"]
    np.testing.assert_array_equal(np.load(tmp_path / "u.npy", allow_pickle=False), table)
    other = SpeedTorch.ModelFactory(emb, 25, 4, CPUPinn=not cpupinn)
    other.loadCupy(str(tmp_path / "u.npy"))                # load without an init, as SpeedTorch
    np.testing.assert_array_equal(other.getNumpyVersion(), table)
    np.save(tmp_path / "wrong.npy", np.zeros((24, 4), np.float32))
    with pytest.raises(ValueError, match="shape"):
        other.loadCupy(str(tmp_path / "wrong.npy"))
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="pickl"):
        other.loadCupy(str(tmp_path / "obj.npy"))
    np.testing.assert_array_equal(other.getNumpyVersion(), table)   # unchanged


def test_save_load_torch_roundtrip(tmp_path):
    emb = torch.nn.Embedding(3, 4)
    pf = SpeedTorch.PytorchModelFactory(emb, 12, 4, deviceType="cpu", pinType=True)
    pf.customInit(torch.nn.init.xavier_uniform_)
    table = pf.getNumpyVersion()
    bound = float(np.sqrt(6.0 / (12 + 4)))                 # full-table fan-in/fan-out
    assert np.abs(table).max() <= bound and np.abs(table).max() > bound / 2
    pf.saveTorch(str(tmp_path / "t.pt"))
    t = torch.load(tmp_path / "t.pt", weights_only=True)
    assert t.device.type == "cpu"
    np.testing.assert_array_equal(t.numpy(), table)
    other = SpeedTorch.PytorchModelFactory(emb, 12, 4, deviceType="cuda")
    other.loadTorch(str(tmp_path / "t.pt"))
    np.testing.assert_array_equal(other.getNumpyVersion(), table)
    torch.save(torch.zeros(3, 3), tmp_path / "bad.pt")
    with pytest.raises(ValueError):
        other.loadTorch(str(tmp_path / "bad.pt"))


@pytest.mark.parametrize("np_dtype", [">f4", np.longdouble], ids=["big-endian", "longdouble"])
@pytest.mark.parametrize("cpupinn", [False, True])
def test_big_endian_npy_files_load(tmp_path, cpupinn, np_dtype):
    """A big-endian ``.npy`` (``np.save`` of a ``'>f4'`` array) or a ``longdouble`` one
    loads with its values (regression: torch's "byte order" ValueError escaped, not an
    stpipe error; torch has no longdouble)."""
    data = (np.arange(24).reshape(8, 3) / 7).astype(np_dtype)
    np.save(tmp_path / "be.npy", data)
    assert np.load(tmp_path / "be.npy").dtype == np.dtype(np_dtype)
    mf = SpeedTorch.ModelFactory(torch.nn.Embedding(2, 3), 8, 3, CPUPinn=cpupinn)
    mf.loadCupy(tmp_path / "be.npy")
    np.testing.assert_array_equal(mf.getNumpyVersion(), data.astype(np.float32))
    g = SpeedTorch.DataGadget(str(tmp_path / "be.npy"), CPUPinn=cpupinn)
    g.gadgetInit()  # a gadget keeps the file's dtype: float32, or float64 for longdouble
    kept = data.astype(np.float32 if np_dtype == ">f4" else np.float64)
    assert g.getNumpyVersion().dtype == kept.dtype
    np.testing.assert_array_equal(g.getNumpyVersion(), kept)
    np.testing.assert_array_equal(g.getData([5, 1]).cpu().numpy(), kept[[5, 1]])


def test_bad_files_and_arguments_raise_stpipe_errors(tmp_path):
    """A truncated ``.npy``, an unreadable ``loadTorch`` file, ``low > high``, a negative
    ``stdDev`` and an unknown ``deviceType`` raise stpipe's ValueError with what was
    expected and what was got (regression: torch's RuntimeError / pickle's
    UnpicklingError escaped, and a truncated file was called pickled); a failed
    initialiser keeps the old table."""
    from stpipe import StpipeValueError

    emb = torch.nn.Embedding(2, 3)
    np.save(tmp_path / "tr.npy", np.zeros((100, 3), np.float32))
    with open(tmp_path / "tr.npy", "r+b") as f:
        f.truncate(200)
    with pytest.raises(StpipeValueError, match=r"expected a whole \.npy array, got 72 bytes of data "
                       r"after a header that describes 1200 .*truncated") as err:
        SpeedTorch.ModelFactory(emb, 100, 3).loadCupy(tmp_path / "tr.npy")
    assert "unpickling" not in str(err.value)
    with pytest.raises(StpipeValueError, match="truncated"):
        SpeedTorch.DataGadget(str(tmp_path / "tr.npy")).gadgetInit()
    (tmp_path / "pickled.npy").write_bytes(__import__("pickle").dumps([1, 2]))
    with pytest.raises(StpipeValueError, match="needs unpickling"):
        SpeedTorch.DataGadget(str(tmp_path / "pickled.npy")).gadgetInit()
    (tmp_path / "bad.pt").write_bytes(b"not a torch file" * 8)
    pf = SpeedTorch.PytorchModelFactory(emb, 8, 3, deviceType="cpu")
    pf.zerosInit()
    with pytest.raises(StpipeValueError, match="expected a tensor saved by torch.save"):
        pf.loadTorch(tmp_path / "bad.pt")
    np.testing.assert_array_equal(pf.getNumpyVersion(), np.zeros((8, 3), np.float32))
    for mf in (SpeedTorch.ModelFactory(emb, 8, 3), SpeedTorch.ModelFactory(emb, 8, 3, CPUPinn=True),
               SpeedTorch.PytorchModelFactory(emb, 8, 3, deviceType="cpu", pinType=True)):
        mf.uniformDistributionInit(0.25, 0.5)
        before = mf.getNumpyVersion()
        with pytest.raises(StpipeValueError, match="expected numbers, got low=nan"):
            mf.uniformDistributionInit(float("nan"), 1)
        with pytest.raises(StpipeValueError, match="expected stdDev >= 0, got -1"):
            mf.normalDistributionInit(0.0, -1)
        np.testing.assert_array_equal(mf.getNumpyVersion(), before)  # the old table stays
        mf.uniformDistributionInit(1, -1)  # SpeedTorch (CuPy) drew between the two
        got = mf.getNumpyVersion()
        assert got.min() >= -1 and got.max() <= 1 and got.std() > 0.1
    model = SkipGram(2, 2, 3)
    opt = torch.optim.Adam(model.parameters())
    for make in (lambda d: SpeedTorch.PytorchModelFactory(emb, 8, 3, deviceType=d),
                 lambda d: SpeedTorch.PytorchOptimizerFactory(opt, 8, 3, model, "u_embeddings", deviceType=d)):
        with pytest.raises(StpipeValueError, match="deviceType: expected 'cuda' .* or 'cpu' .*got 'gpu'"):
            make("gpu")
        with pytest.raises(StpipeValueError, match="got 'meta'"):
            make("meta")
    assert len(emb._forward_pre_hooks) <= 1  # a refused switcher left no hook behind


@pytest.mark.parametrize("make", [
    lambda emb: SpeedTorch.PytorchModelFactory(emb, 16, 8, deviceType="cpu"),
    lambda emb: SpeedTorch.PytorchModelFactory(emb, 16, 8, deviceType="cpu", pinType=True),
    lambda emb: SpeedTorch.CPUPytorchModelFactory(emb, 16, 8),
    lambda emb: SpeedTorch.CPUPytorchModelFactory(emb, 16, 8, datatype="float16"),
    lambda emb: SpeedTorch.PytorchModelFactory(emb, 16, 8, deviceType="cuda"),  # a CPU tensor without CUDA
], ids=["cpu", "cpu-pinned", "CPUPytorch", "CPUPytorch-float16", "cuda"])
def test_custom_init_takes_non_elementwise_functions(make):
    """customInit takes any torch.nn.init function on host tables too, as SpeedTorch did:
    orthogonal_, eye_ and sparse_ run on a full tensor, then are copied in (regression:
    refused as not elementwise); elementwise ones still run chunk-wise; a function that
    fails on a table of this shape raises stpipe's ValueError."""
    from stpipe import StpipeValueError

    emb = torch.nn.Embedding(4, 8)
    torch.manual_seed(0)
    pf = make(emb)
    half = pf._dtype == torch.float16
    pf.customInit(torch.nn.init.orthogonal_)
    w = pf.getNumpyVersion().astype(np.float64)  # (16, 8): orthonormal columns
    np.testing.assert_allclose(w.T @ w, np.eye(8), atol=5e-3 if half else 1e-5)
    pf.customInit(torch.nn.init.eye_)
    np.testing.assert_array_equal(pf.getNumpyVersion(), np.eye(16, 8))
    pf.customInit(torch.nn.init.sparse_, 0.5, 0.1)
    w = pf.getNumpyVersion()
    assert ((w == 0).sum(axis=0) == 8).all() and (w != 0).any()  # half of each column zero
    pf.customInit(torch.nn.init.constant_, 0.25)
    np.testing.assert_array_equal(pf.getNumpyVersion(), np.full((16, 8), 0.25))
    with pytest.raises(StpipeValueError, match="dirac_"):
        pf.customInit(torch.nn.init.dirac_)
    # the failed fill left no table, not a half-written one (regression: torch.empty rows)
    from stpipe import StpipeRuntimeError
    with pytest.raises(StpipeRuntimeError, match="no table yet"):
        pf.getNumpyVersion()
    pf.customInit(torch.nn.init.constant_, 0.5)  # and a new init gives one again
    np.testing.assert_array_equal(pf.getNumpyVersion(), np.full((16, 8), 0.5))


def test_api_surface_and_defaults():
    import importlib

    mod = importlib.import_module("stpipe.compat.speedtorch")
    from stpipe.compat import speedtorch as again
    assert mod is again is SpeedTorch
    sig = lambda c: {k: v.default for k, v in inspect.signature(c).parameters.items()}  # noqa: E731
    assert sig(SpeedTorch.ModelFactory)["datatype"] == "float32"
    assert sig(SpeedTorch.ModelFactory)["CPUPinn"] is False
    assert list(sig(SpeedTorch.ModelFactory))[:5] == ["model_variable", "total_classes", "embed_dimension", "datatype", "CPUPinn"]
    assert list(sig(SpeedTorch.OptimizerFactory))[:7] == ["given_optimizer", "total_classes", "embed_dimension", "model", "variable_name", "dtype", "CPUPinn"]
    p = sig(SpeedTorch.PytorchModelFactory)
    assert (p["datatype"], p["deviceType"], p["pinType"]) == ("float32", "cuda", False)
    p = sig(SpeedTorch.PytorchOptimizerFactory)
    assert (p["dtype"], p["deviceType"], p["pinType"]) == ("float32", "cuda", False)
    assert list(sig(SpeedTorch.DataGadget)) == ["fileName", "CPUPinn"]
    for name in ("GPUPytorchModelFactory", "GPUPytorchOptimizerFactory",
                 "CPUPytorchModelFactory", "CPUPytorchOptimizerFactory",
                 "ModelFactoryMM", "OptimizerFactoryMM", "DataGadgetMM"):
        assert name in SpeedTorch.__all__
    assert list(sig(SpeedTorch.ModelFactoryMM))[:6] == ["model_variable", "total_classes", "embed_dimension",
                                                       "diskname", "datatype", "CPUPinn"]
    assert sig(SpeedTorch.ModelFactoryMM)["diskname"] == "variable"
    assert list(sig(SpeedTorch.DataGadgetMM)) == ["fileName", "CPUPinn"]
    for meth in ("zerosInit", "uniformDistributionInit", "normalDistributionInit",
                 "variableTransformer", "beforeForwardPass", "afterOptimizerStep",
                 "saveCupy", "loadCupy", "getNumpyVersion"):
        assert callable(getattr(SpeedTorch.ModelFactory, meth))
    for meth in ("customInit", "saveTorch", "loadTorch", "getNumpyVersion"):
        assert callable(getattr(SpeedTorch.PytorchModelFactory, meth))


def test_aliases_place_tables_like_speedtorch():
    model = SkipGram(4, 8, 4)
    c = SpeedTorch.CPUPytorchModelFactory(model.u_embeddings, 10, 4)
    c.zerosInit()
    assert c._store.__class__.__name__ == "_HostStore"
    g = SpeedTorch.GPUPytorchModelFactory(model.v_embeddings, 10, 4)
    g.zerosInit()
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert g._store.device.type == want
    opt = torch.optim.Adam(model.parameters())
    co = SpeedTorch.CPUPytorchOptimizerFactory(opt, 10, 4, model, "u_embeddings")
    go = SpeedTorch.GPUPytorchOptimizerFactory(opt, 10, 4, model, "v_embeddings")
    co.optInit()
    go.optInit()
    assert co.optVarList == go.optVarList == ["exp_avg", "exp_avg_sq"]


@pytest.mark.parametrize("cpupinn", [False, True])
def test_memory_mapped_variants_train_like_the_plain_classes(tmp_path, cpupinn):
    """ModelFactoryMM / OptimizerFactoryMM (SpeedTorch's signatures, ``diskname`` too)
    train exactly as ModelFactory / OptimizerFactory, and write no file."""
    out = []
    for mm in (False, True):
        torch.manual_seed(0)
        model = SkipGram(4, 4 * 3, 5)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        if mm:
            sw = SpeedTorch.ModelFactoryMM(model.v_embeddings, 40, 5, diskname=str(tmp_path / "v"),
                                           CPUPinn=cpupinn)
            assert sw.diskname == str(tmp_path / "v")
            osw = SpeedTorch.OptimizerFactoryMM(opt, 40, 5, model, "v_embeddings", CPUPinn=cpupinn)
        else:
            sw = SpeedTorch.ModelFactory(model.v_embeddings, 40, 5, CPUPinn=cpupinn)
            osw = SpeedTorch.OptimizerFactory(opt, 40, 5, model, "v_embeddings", CPUPinn=cpupinn)
        sw.uniformDistributionInit(-0.1, 0.1)
        osw.optInit()
        pos_d, neg_d = (torch.as_tensor(a) for a in sw.variableTransformer(4, 1, 2))
        u_d = torch.arange(4).reshape(4, 1)
        rng = np.random.default_rng(1)
        for _ in range(3):
            pos = rng.integers(0, 40, (4, 1))
            neg = rng.integers(0, 40, (4, 2))
            sw.beforeForwardPass(pos, neg)
            osw.beforeForwardPass(pos, neg)
            loss = model(u_d, pos_d.reshape(4, 1), neg_d)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sw.afterOptimizerStep(pos, neg)
            osw.afterOptimizerStep(pos, neg)
        out.append((sw.getNumpyVersion(), osw.getNumpyVersion()))
    (w0, s0), (w1, s1) = out
    np.testing.assert_array_equal(w0, w1)
    assert s0.keys() == s1.keys()
    for key in s0:
        np.testing.assert_array_equal(s0[key], s1[key])
    assert not any(tmp_path.iterdir())  # no memmap file


def test_datagadget_mm_takes_the_switchers_pair_of_ids(tmp_path):
    data = np.arange(30, dtype=np.float32).reshape(10, 3)
    np.save(tmp_path / "d.npy", data)
    g = SpeedTorch.DataGadgetMM(str(tmp_path / "d.npy"))
    g.gadgetInit()
    pos, neg = np.array([[1], [4]]), np.array([[2, 2], [9, 0]])
    got = g.getData(pos, neg).cpu().numpy()
    np.testing.assert_array_equal(got, data[[1, 4, 2, 2, 9, 0]])
    np.testing.assert_array_equal(g.getData(pos).cpu().numpy(), data[[1, 4]])
    with pytest.raises(IndexError):
        g.getData(pos, np.array([10]))


@pytest.mark.parametrize("name,hint", [("COM", "torch.zeros"), ("PytorchCOM", "torch.zeros"),
                                       ("my_pinned_allocator", "CPUPinn=True"), ("PMemoryMM", "CPUPinn=True")])
def test_names_not_carried_over_say_what_to_use(name, hint):
    with pytest.raises(AttributeError, match=hint):
        getattr(SpeedTorch, name)
    assert not hasattr(SpeedTorch, name)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'$"):
        SpeedTorch.NoSuchName  # noqa: B018


@pytest.mark.skipif(SpeedTorch._cupy_installed(), reason="CuPy is installed here")
def test_missing_cupy_warns_once():
    SpeedTorch._warned.discard("cupy")
    emb = torch.nn.Embedding(3, 4)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        SpeedTorch.ModelFactory(emb, 10, 4)
        SpeedTorch.ModelFactory(emb, 10, 4, CPUPinn=True)
        SpeedTorch.DataGadget("x.npy")
        SpeedTorch.PytorchModelFactory(emb, 10, 4, deviceType="cpu")
    cupy_w = [w for w in got if issubclass(w.category, SpeedTorch.CupyFallbackWarning)]
    assert len(cupy_w) == 1
    assert "torch backend" in str(cupy_w[0].message)
    assert cupy_w[0].filename == __file__                  # points at the user's line


# ---------------------------------------------------------------------------------------
# DataGadget
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("cpupinn", [False, True])
def test_datagadget_roundtrip(tmp_path, cpupinn):
    rng = np.random.default_rng(0)
    data = rng.standard_normal((50, 6)).astype(np.float32)
    np.save(tmp_path / "d.npy", data)
    g = SpeedTorch.DataGadget(str(tmp_path / "d.npy"), CPUPinn=cpupinn)
    g.gadgetInit()
    want_dev = "cuda" if torch.cuda.is_available() else "cpu"
    idx = np.array([[4, 49], [0, 4]])
    got = g.getData(idx)
    assert got.device.type == want_dev and got.shape == (2, 2, 6)
    np.testing.assert_array_equal(got.cpu().numpy(), data[idx])
    np.testing.assert_array_equal(g.getData([7, 1]).cpu().numpy(), data[[7, 1]])
    np.testing.assert_array_equal(g.getData(slice(10, 13)).cpu().numpy(), data[10:13])
    np.testing.assert_array_equal(g.getData(torch.tensor([3])).cpu().numpy(), data[[3]])
    # insert: rows of a tensor; a repeated id keeps its last occurrence
    new = torch.arange(24, dtype=torch.float32).view(4, 6).to(want_dev)
    g.insertData(new, np.array([9, 2, 9, 30]))
    data[[2, 9, 30]] = new.cpu().numpy()[[1, 2, 3]]
    np.testing.assert_array_equal(g.getNumpyVersion(), data)
    g.insertData(new[:2].reshape(1, 2, 6), np.array([[11, 12]]))
    data[[11, 12]] = new[:2].cpu().numpy()
    g.saveCupy(str(tmp_path / "out"))
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), data)
    h = SpeedTorch.DataGadget(str(tmp_path / "d.npy"), CPUPinn=not cpupinn)
    h.gadgetInit()
    h.loadCupy(str(tmp_path / "out.npy"))
    np.testing.assert_array_equal(h.getNumpyVersion(), data)
    with pytest.raises(IndexError):
        g.getData(np.array([0, 50]))
    with pytest.raises(IndexError):
        g.insertData(new[:1], np.array([-1]))
    with pytest.raises(ValueError):
        g.insertData(new, np.array([1, 2]))
    np.testing.assert_array_equal(g.getNumpyVersion(), data)


@pytest.mark.parametrize("cpupinn", [False, True])
@pytest.mark.parametrize("ids", [
    np.array([1, 4, 9, 30]),            # strictly increasing: no repeat check at all
    np.array([1, 4, 4, 9]),             # non-decreasing with a repeat
    np.array([30, 9, 4, 1]),            # distinct, descending
    np.array([9, 2, 9, 2], np.int32),   # int32 with repeats, unsorted
    slice(40, 10, -10),                 # a negative-step slice: 40, 30, 20
    slice(3, 9, 2),                     # 3, 5, 7
], ids=["increasing", "nondecreasing", "descending", "int32-repeats", "slice-down", "slice-up"])
def test_datagadget_every_id_order(tmp_path, cpupinn, ids):
    """getData/insertData give numpy's answers (last occurrence wins on insert) whatever
    order the ids come in: the order found by the one checking pass picks the path."""
    rng = np.random.default_rng(1)
    data = rng.standard_normal((50, 3)).astype(np.float32)
    np.save(tmp_path / "d.npy", data)
    g = SpeedTorch.DataGadget(str(tmp_path / "d.npy"), CPUPinn=cpupinn)
    g.gadgetInit()
    flat = np.arange(50)[ids] if isinstance(ids, slice) else ids
    # the order the checking pass reports decides whether repeats are looked for: on CPU
    # a wrong "strictly increasing" would go unseen (index_copy_ writes in order)
    d = np.diff(flat.astype(np.int64))
    want = 2 if (d > 0).all() else (1 if (d >= 0).all() else 0)
    assert SpeedTorch.DataGadget._ids(ids, g._store)[2] == want
    np.testing.assert_array_equal(g.getData(ids).cpu().numpy(), data[flat])
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    new = torch.arange(len(flat) * 3, dtype=torch.float32).view(len(flat), 3).to(dev)
    g.insertData(new, ids)
    for j, i in enumerate(flat.tolist()):  # in order: the last occurrence wins
        data[i] = new[j].cpu().numpy()
    np.testing.assert_array_equal(g.getNumpyVersion(), data)


@pytest.mark.parametrize("shape,dtype", [((20,), np.float32), ((10, 3, 2), np.float64),
                                         ((10, 4), np.float16), ((10, 2), np.int32)])
def test_datagadget_other_shapes_and_dtypes(tmp_path, shape, dtype):
    data = (np.arange(int(np.prod(shape))) % 7).reshape(shape).astype(dtype)
    np.save(tmp_path / "d.npy", data)
    for pin in (False, True):
        g = SpeedTorch.DataGadget(str(tmp_path / "d.npy"), CPUPinn=pin)
        g.gadgetInit()
        np.testing.assert_array_equal(g.getData([3, 1, 3]).cpu().numpy(), data[[3, 1, 3]])
        np.testing.assert_array_equal(g.getNumpyVersion(), data)
        g.saveCupy(str(tmp_path / f"o{pin}.npy"))
        back = np.load(tmp_path / f"o{pin}.npy")
        assert back.shape == data.shape
        np.testing.assert_array_equal(back, data)


@pytest.mark.parametrize("cpupinn", [False, True])
def test_datagadget_insert_requires_the_data_shape_of_its_ids(tmp_path, cpupinn):
    """insertData takes data shaped ``ids.shape + row_shape`` or ``(n, *row_shape)``;
    data with the right element count but another shape (a transposed batch, rows of
    another width) raises StpipeValueError naming both shapes, and nothing is written
    (regression: only the element count was compared and the rows came out scrambled)."""
    from stpipe import StpipeValueError

    data = np.zeros((8, 3, 2), np.float32)  # rows of shape (3, 2)
    np.save(tmp_path / "d.npy", data)
    g = SpeedTorch.DataGadget(str(tmp_path / "d.npy"), CPUPinn=cpupinn)
    g.gadgetInit()
    ids = np.array([[0, 1], [2, 3]])
    rows = torch.arange(24, dtype=torch.float32).reshape(4, 3, 2)
    for bad in (rows.reshape(2, 2, 6), rows.permute(0, 2, 1).contiguous(), rows.reshape(4, 6),
                rows.reshape(24), rows.reshape(2, 12), rows.reshape(1, 4, 3, 2)):
        with pytest.raises(StpipeValueError) as err:
            g.insertData(bad, ids)
        msg = str(err.value)
        assert "expected data of shape (2, 2, 3, 2) or (4, 3, 2)" in msg
        assert f"got {tuple(bad.shape)}" in msg
        np.testing.assert_array_equal(g.getNumpyVersion(), data)  # nothing written
    with pytest.raises(ValueError, match=r"expected data of shape \(4, 3, 2\) \(the ids"):
        g.insertData(rows.permute(0, 2, 1).contiguous(), ids.reshape(-1))  # (4, 2, 3)
    np.testing.assert_array_equal(g.getNumpyVersion(), data)
    # the two shapes the docstring names both write the rows
    g.insertData(rows.reshape(2, 2, 3, 2), ids)
    np.testing.assert_array_equal(g.getNumpyVersion()[:4], rows.numpy())
    g.insertData(rows.flip(0), ids)
    np.testing.assert_array_equal(g.getNumpyVersion()[:4], rows.flip(0).numpy())
    # a 2-d table: a transposed batch is refused, the same batch as rows is taken
    np.save(tmp_path / "t.npy", np.zeros((8, 3), np.float32))
    t = SpeedTorch.DataGadget(str(tmp_path / "t.npy"), CPUPinn=cpupinn)
    t.gadgetInit()
    batch = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    with pytest.raises(StpipeValueError, match=r"expected data of shape \(4, 3\).*got \(3, 4\)"):
        t.insertData(batch.t().contiguous(), np.arange(4))
    np.testing.assert_array_equal(t.getNumpyVersion(), np.zeros((8, 3), np.float32))
    t.insertData(batch, np.arange(4))
    np.testing.assert_array_equal(t.getNumpyVersion()[:4], batch.numpy())


def test_datagadget_before_init_raises():
    with pytest.raises(RuntimeError, match="gadgetInit"):
        SpeedTorch.DataGadget("nowhere.npy").getData([0])


def test_tensor_store_scatter_last_unchecked_ids_raise_and_write_nothing():
    """The torch-op twin of the GPU last-wins insert (here on a CPU tensor): repeats keep
    their last occurrence over several calls, and unchecked ids out of range raise
    IndexError, naming the first bad one, before anything is written."""
    from stpipe.compat.speedtorch import _TensorStore

    rng = np.random.default_rng(8)
    data = torch.from_numpy(rng.standard_normal((50, 8)).astype(np.float32))
    store = _TensorStore(data.clone())
    want = data.clone()
    for _ in range(3):
        ids = rng.integers(0, 10, 40)
        rows = torch.randn(40, 8)
        store.scatter_last(torch.from_numpy(ids), rows, checked=False)
        for j, i in enumerate(ids):
            want[i] = rows[j]
        assert torch.equal(store.t, want)
    with pytest.raises(IndexError, match="row id 50 at position 1"):
        store.scatter_last(torch.tensor([3, 50, 4]), torch.ones(3, 8), checked=False)
    with pytest.raises(IndexError, match="row id -2 at position 0"):
        store.scatter_last(torch.tensor([-2]), torch.ones(1, 8), checked=False)
    assert torch.equal(store.t, want)


@pytest.mark.parametrize("fused", [False, True])
def test_bench_speedtorch_step_fix_turns_int_steps_into_tensors(fused):
    """The benchmarks' one change to SpeedTorch 0.1.6's optimizer state: its int ``step``
    becomes the tensor Adam expects (float32; on the parameter's device for fused Adam),
    other state is left alone, and Adam then steps."""
    from stpipe._bench import _speedtorch_step_fix

    p = torch.nn.Parameter(torch.zeros(3, 2))
    opt = torch.optim.Adam([p], lr=0.1, **({"fused": True} if fused else {}))
    avg = torch.zeros(3, 2)
    opt.state[p].update(step=0, exp_avg=avg, exp_avg_sq=torch.zeros(3, 2))  # as SpeedTorch seeds it
    _speedtorch_step_fix(opt)
    assert torch.is_tensor(opt.state[p]["step"]) and float(opt.state[p]["step"]) == 0.0
    assert opt.state[p]["step"].dtype == torch.float32 and opt.state[p]["step"].device == p.device
    assert opt.state[p]["exp_avg"] is avg
    p.grad = torch.ones(3, 2)
    opt.step()
    assert float(opt.state[p]["step"]) == 1.0
    assert torch.allclose(p.detach(), torch.full((3, 2), -0.1))


# ---------------------------------------------------------------------------------------
# the fused gather/write-back of a weight and its optimizer state (pinned host tables)
# ---------------------------------------------------------------------------------------
ORDERS = ["pattern", "opt-first", "state-replaced", "opt-before-twice", "no-opt-after"]


def _force_fusing(monkeypatch, on: bool) -> list:
    """Fused moves on (CPU too: ``host.gather_many`` falls back to table-by-table there,
    so the stash logic runs the same) or off; returns a list that counts fused gathers."""
    calls: list = []
    if not on:
        monkeypatch.setattr(SpeedTorch, "_fusable", lambda stores, device: False)
        return calls
    real = SpeedTorch._fusable

    def fusable(stores, device):
        ok = (real(stores, device) if device.type == "cuda"
              else len(stores) > 1 and all(isinstance(s, SpeedTorch._HostStore) for s in stores))
        calls.append(ok)
        return ok

    monkeypatch.setattr(SpeedTorch, "_fusable", fusable)
    return calls


def _pinned_pattern(device, make_opt, B, P, N, n_u, n_v, dim):
    """The skip-gram pattern's pieces with pinned tables: ``(model, [u, v] model
    switchers, optimizer, [u, v] optimizer switchers, (u, pos, neg) dummies)``."""
    torch.manual_seed(0)
    model = SkipGram(B, B * (P + N), dim).to(device)
    sw = [SpeedTorch.ModelFactory(model.u_embeddings, n_u, dim, CPUPinn=True),
          SpeedTorch.ModelFactory(model.v_embeddings, n_v, dim, CPUPinn=True)]
    for s in sw:
        s.uniformDistributionInit(-0.5, 0.5)
    opt = make_opt(model.parameters())
    osw = [SpeedTorch.OptimizerFactory(opt, n_u, dim, model, "u_embeddings", CPUPinn=True),
           SpeedTorch.OptimizerFactory(opt, n_v, dim, model, "v_embeddings", CPUPinn=True)]
    for o in osw:
        o.optInit()
    ud = torch.as_tensor(sw[0].variableTransformer(B, 1), device=device)
    pd, nd = (torch.as_tensor(a, device=device) for a in sw[1].variableTransformer(B, P, N))
    return model, sw, opt, osw, (ud, pd, nd)


def _pattern_step(model, sw, opt, osw, dummies, u, pos, neg) -> torch.Tensor:
    """One Adam step of :func:`_pinned_pattern`'s pieces on the ids ``u``, ``pos``,
    ``neg``, the switchers called in the documented order; returns the loss."""
    sw[0].beforeForwardPass(u)
    sw[1].beforeForwardPass(pos, neg)
    osw[0].beforeForwardPass(u)
    osw[1].beforeForwardPass(pos, neg)
    loss = model(*dummies)
    opt.zero_grad()
    loss.backward()
    opt.step()
    for s, a in ((sw[0], (u,)), (sw[1], (pos, neg)), (osw[0], (u,)), (osw[1], (pos, neg))):
        s.afterOptimizerStep(*a)
    return loss


def _pattern_tables(sw, osw) -> dict:
    """Every table of :func:`_pinned_pattern`'s switchers: ``u``, ``v``, ``u.<state key>``..."""
    out = {name: s.getNumpyVersion() for name, s in zip("uv", sw)}
    for name, o in zip("uv", osw):
        out.update({f"{name}.{k}": t for k, t in o.getNumpyVersion().items()})
    return out


def _run_orders(device, opt_name, order, dups, steps=6, B=4, P=2, N=3, n_u=30, n_v=40, dim=8):
    """The pattern with pinned tables and the switcher calls in ``order``; returns every
    table (weights and state) and the losses."""
    model, sw, opt, osw, (ud, pd, nd) = _pinned_pattern(device, OPTIMIZERS[opt_name], B, P, N, n_u, n_v, dim)
    rng = np.random.default_rng(1)
    batches = make_batches(rng, steps, B, P, N, n_u, n_v, dups != "unique")
    if dups == "same-batch":  # identical consecutive batches: one layout object reused
        batches = [batches[0]] * steps
    losses = []
    for u, v, neg in batches:
        args = [(u,), (v, neg)]
        before = [(o, a) for o, a in zip(osw, args)] + [(s, a) for s, a in zip(sw, args)]
        if order != "opt-first":
            before = before[2:] + before[:2]  # model switchers first, as documented
        for s, a in before:
            s.beforeForwardPass(*a)
        if order == "opt-before-twice":
            for o, a in zip(osw, args):
                o.beforeForwardPass(*a)  # reads the tables again
        loss = model(ud, pd, nd)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if order == "state-replaced":  # the user swaps a state tensor for a new one
            st = opt.state[model.v_embeddings.weight]
            key = next(k for k, t in st.items() if torch.is_tensor(t) and t.dim() == 2)
            st[key] = st[key] * 0.5
        after = [(s, a) for s, a in zip(sw, args)] + [(o, a) for o, a in zip(osw, args)]
        if order == "opt-first":
            after = after[2:] + after[:2]
        if order == "no-opt-after":
            after = after[:2]
        for s, a in after:
            s.afterOptimizerStep(*a)
        losses.append(float(loss.detach()))
    return {"losses": np.array(losses), **_pattern_tables(sw, osw)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dups", ["unique", "duplicates", "same-batch"])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("opt_name", ["Adam", "Adagrad", "RMSprop-centered-momentum", "Rprop"])
def test_fused_state_moves_bit_identical_to_unfused(monkeypatch, device, opt_name, order, dups):
    """A pinned weight and its optimizer-state tables move in one fused gather, and the
    state tables in one fused write-back when the optimizer stepped on the installed
    tensors, together with the weight rows when the model switcher's
    ``afterOptimizerStep`` came first (it leaves them to that launch). Whatever the order
    of the switcher calls, the tables (weights and state) and losses are bit-identical to
    moving each table on its own: a state tensor the user replaced is written from the
    new tensor, a second ``beforeForwardPass`` re-reads the table, and a skipped optimizer
    ``afterOptimizerStep`` writes no state (the weight rows left for it are written when
    the table is next read)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    calls = _force_fusing(monkeypatch, True)
    deferred = []
    real_defers = SpeedTorch._Stash.defers_weight

    def defers(self, *args):
        ok = real_defers(self, *args)
        deferred.append(ok)
        return ok

    monkeypatch.setattr(SpeedTorch._Stash, "defers_weight", defers)
    fused = _run_orders(device, opt_name, order, dups)
    assert any(calls), "the fused path never ran"
    # the model switcher leaves its write-back to the optimizer switcher's launch
    # whenever it is called first (every order but opt-first)
    assert any(deferred) == (order != "opt-first")
    monkeypatch.undo()
    _force_fusing(monkeypatch, False)
    plain = _run_orders(device, opt_name, order, dups)
    assert fused.keys() == plain.keys()
    for key in plain:
        np.testing.assert_array_equal(fused[key], plain[key], err_msg=key)


def _gathered_pair(device):
    """A skip-gram model's ``v`` table (40 x 8, pinned) and its Adam state, switched in
    for one batch: ``(model, model switcher, optimizer, optimizer switcher, (v, neg))``."""
    model = SkipGram(4, 4 * 5, 8).to(device)
    sw = SpeedTorch.ModelFactory(model.v_embeddings, 40, 8, CPUPinn=True)
    sw.uniformDistributionInit(-1, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    osw = SpeedTorch.OptimizerFactory(opt, 40, 8, model, "v_embeddings", CPUPinn=True)
    osw.optInit()
    v, neg = np.arange(8).reshape(4, 2), np.arange(8, 20).reshape(4, 3)
    sw.beforeForwardPass(v, neg)
    osw.beforeForwardPass(v, neg)
    return model, sw, opt, osw, (v, neg)


@pytest.mark.parametrize("device", DEVICES)
def test_switchers_and_their_tables_are_freed_when_dropped(device):
    """Nothing in the compat layer keeps a dropped model, its switchers or their tables
    alive (the fused moves' registry of optimizer switchers is weak both ways)."""
    import gc
    import weakref

    model, sw, opt, osw, (v, neg) = _gathered_pair(device)
    refs = [weakref.ref(x) for x in (sw, osw, sw._store, *osw._tables.values(), model)]
    del model, sw, osw, opt
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("when", ["write-back-deferred", "after-gather"])
def test_dropped_switchers_are_freed_while_the_model_lives(monkeypatch, device, when):
    """Switchers dropped by the user while the model lives on are freed with their
    tables: the weight's layout holds the fused gather's stash weakly, and the stash its
    model switcher weakly (regression: the stash kept the switchers' full tables alive
    as long as the weight). A model switcher whose weight write-back waits for the
    optimizer switcher's fused launch can go alone; the optimizer switcher's write-back
    then writes its own state as usual."""
    import gc
    import weakref

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    calls = _force_fusing(monkeypatch, True)
    model, sw, opt, osw, (v, neg) = _gathered_pair(device)
    assert any(calls), "the fused path never ran"
    if when == "after-gather":
        refs = [weakref.ref(x) for x in (sw, osw, sw._store, *osw._tables.values())]
        del sw, osw
        gc.collect()
        assert [r() is None for r in refs] == [True] * len(refs)
        assert model.v_embeddings.weight.shape == (20, 8)
        return
    (model.v_embeddings(torch.arange(20, device=device)) ** 2).sum().backward()
    opt.step()
    sw.afterOptimizerStep(v, neg)
    assert sw._pending is not None  # deferred to the optimizer switcher's launch
    state = {k: t.detach().cpu().numpy().copy() for k, t in opt.state[model.v_embeddings.weight].items()
             if t.dim() == 2}
    refs = [weakref.ref(sw), weakref.ref(sw._store)]
    del sw
    gc.collect()
    assert [r() is None for r in refs] == [True, True]
    osw.afterOptimizerStep(v, neg)
    tables = osw.getNumpyVersion()
    for key, want in state.items():
        np.testing.assert_array_equal(tables[key][:20], want, err_msg=key)


@pytest.mark.parametrize("old_kept", [False, True], ids=["old-dropped", "old-kept"])
def test_second_switcher_on_a_module_takes_over_its_remapping_hook(tmp_path, old_kept):
    """A new model switcher on a module (a new run, a reload) replaces the old one's
    forward pre-hook: one hook per module, so dummy positions are remapped once, by the
    layout of the switcher whose rows the weight holds; an old switcher still in use
    takes the hook back when it swaps its rows in (regression: the old hook stayed and
    remapped the positions a second time)."""
    import gc

    torch.manual_seed(0)
    emb = torch.nn.Embedding(6, 2)
    old = SpeedTorch.ModelFactory(emb, 30, 2)
    old.uniformDistributionInit(-1, 1)
    old.beforeForwardPass(np.array([5, 9, 5, 9, 7, 7]))  # duplicates: remapping on
    old.saveCupy(tmp_path / "u")
    table = old.getNumpyVersion()
    if not old_kept:
        del old
        gc.collect()
    new = SpeedTorch.ModelFactory(emb, 30, 2)
    new.loadCupy(tmp_path / "u.npy")
    ids = np.array([3, 1, 3, 8, 2, 4])
    new.beforeForwardPass(ids)
    assert len(emb._forward_pre_hooks) == 1
    np.testing.assert_array_equal(emb(torch.arange(6)).detach().numpy(), table[ids])
    if old_kept:  # the old switcher swaps its rows in again: its layout remaps, once
        back = np.array([2, 2, 0, 6, 6, 6])
        old.beforeForwardPass(back)
        assert len(emb._forward_pre_hooks) == 1
        np.testing.assert_array_equal(emb(torch.arange(6)).detach().numpy(), table[back])
        old.close()  # not the owner any more: the new switcher's hook stays
        new.beforeForwardPass(ids)
        assert len(emb._forward_pre_hooks) == 1
        np.testing.assert_array_equal(emb(torch.arange(6)).detach().numpy(), table[ids])
    new.close()
    assert len(emb._forward_pre_hooks) == 0


def test_dropped_switchers_and_tables_are_freed_while_the_module_lives():
    """Re-creating a switcher for the same module keeps no earlier switcher (nor its full
    table) alive: the module's hook refers to its switcher weakly and leaves the module
    with it (regression: the hook was a bound method, so the module kept every
    switcher and table)."""
    import gc
    import weakref

    emb = torch.nn.Embedding(4, 16)
    refs = []
    for _ in range(3):
        sw = SpeedTorch.ModelFactory(emb, 1000, 16)
        sw.zerosInit()
        sw.beforeForwardPass(np.array([1, 2, 2, 4]))
        emb(torch.arange(4))  # the hook ran
        refs.append((weakref.ref(sw), weakref.ref(sw._store.t)))
        assert len(emb._forward_pre_hooks) == 1
        del sw
        gc.collect()
        assert len(emb._forward_pre_hooks) == 0
    assert [(s() is None, t() is None) for s, t in refs] == [(True, True)] * 3


@pytest.mark.parametrize("with_neg", [False, True])
def test_id_buffer_reused_and_mutated_in_place(with_neg):
    """A batch whose ids come in the same numpy buffer as the last one, refilled in place,
    gets its own rows (the layout of the last batch is reused only when the ids match,
    part by part); the same ids in new arrays reuse it and give the same rows."""
    emb = torch.nn.Embedding(6, 4)
    sw = SpeedTorch.ModelFactory(emb, 50, 4)
    sw.uniformDistributionInit(-1.0, 1.0)
    table = sw.getNumpyVersion()
    pos = np.array([[3, 7], [9, 1]])
    neg = np.array([[20], [21]]) if with_neg else None
    args = (pos, neg) if with_neg else (pos,)

    def want():
        ids = np.concatenate([pos.ravel()] + ([neg.ravel()] if with_neg else []))
        return table[ids]

    sw.beforeForwardPass(*args)
    np.testing.assert_array_equal(emb.weight.detach().numpy(), want())
    pos[:] = [[11, 12], [13, 14]]  # refilled in place: new ids, same objects
    if with_neg:
        neg[:] = [[30], [31]]
    sw.beforeForwardPass(*args)
    np.testing.assert_array_equal(emb.weight.detach().numpy(), want())
    again = (pos.copy(), neg.copy()) if with_neg else (pos.copy(),)
    sw.beforeForwardPass(*again)
    np.testing.assert_array_equal(emb.weight.detach().numpy(), want())
    if with_neg:  # the same flat ids split differently between pos and neg: still the same rows
        flat = np.concatenate([pos.ravel(), neg.ravel()])
        sw.beforeForwardPass(flat[:3].reshape(1, 3), flat[3:].reshape(1, 3))
        np.testing.assert_array_equal(emb.weight.detach().numpy(), want())


def test_weak_id_map_drops_entries_with_their_keys():
    """The switchers' per-parameter registry: found by identity (not by tensor
    equality), dropped when the key dies, and an old key's death never removes the
    entry of a new key that reuses its id."""
    import gc

    from stpipe.compat.speedtorch import _WeakIdMap

    m = _WeakIdMap()
    a, b = torch.zeros(2), torch.zeros(2)  # equal values, distinct objects
    m[a] = "a"
    assert m.get(a) == "a" and m.get(b) is None and m.get(b, 7) == 7
    assert a in m and b not in m and len(m) == 1
    m[b] = "b"
    m[a] = "a2"  # replaced; the first entry's callback must not remove the second
    gc.collect()
    assert m.get(a) == "a2" and m.get(b) == "b" and len(m) == 2
    del m[b]
    assert b not in m and len(m) == 1
    with pytest.raises(KeyError):
        del m[b]
    m[b] = "b"
    del a
    gc.collect()
    assert len(m) == 1 and m.get(b) == "b" and len(m._d) == 1
    # a new object that happens to get the dead key's id is not found under the old entry
    for _ in range(50):
        c = torch.zeros(2)
        assert m.get(c) is None


def _refill_loop(device, order, fresh, steps=6, B=4, P=2, N=3, n_u=30, n_v=40, dim=8):
    """The pattern with Adam, every batch written into the same id buffers in place
    (``fresh``: a new copy of the ids for every switcher call instead)."""
    model, sw, opt, osw, (ud, pd, nd) = _pinned_pattern(device, OPTIMIZERS["Adam"], B, P, N, n_u, n_v, dim)
    rng = np.random.default_rng(3)
    bufs = [np.zeros((B, 1), np.int64), np.zeros((B, P), np.int64), np.zeros((B, N), np.int64)]
    for batch in make_batches(rng, steps, B, P, N, n_u, n_v, True):
        for buf, ids in zip(bufs, batch):
            buf[...] = ids  # the loader's buffers, refilled in place

        def args(i):
            got = [(bufs[0],), (bufs[1], bufs[2])][i]
            return tuple(a.copy() for a in got) if fresh else got

        before = [(sw[0], 0), (sw[1], 1), (osw[0], 0), (osw[1], 1)]
        if order == "opt-first":
            before = before[2:] + before[:2]
        for s, i in before:
            s.beforeForwardPass(*args(i))
        loss = model(ud, pd, nd)
        opt.zero_grad()
        loss.backward()
        opt.step()
        after = [(sw[0], 0), (sw[1], 1), (osw[0], 0), (osw[1], 1)]
        if order == "opt-first":
            after = after[2:] + after[:2]
        for s, i in after:
            s.afterOptimizerStep(*args(i))
    return _pattern_tables(sw, osw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ["pattern", "opt-first"])
def test_ids_refilled_in_place_between_steps_are_seen(device, order):
    """Later calls of a step take its layout when given the same id arrays still holding
    its ids; the first call of the next step compares, so a loader that refills the same
    buffers in place trains exactly as one that hands new arrays to every call."""
    refilled = _refill_loop(device, order, fresh=False)
    fresh = _refill_loop(device, order, fresh=True)
    assert refilled.keys() == fresh.keys()
    for key in fresh:
        np.testing.assert_array_equal(refilled[key], fresh[key], err_msg=key)


def test_later_calls_of_a_step_reuse_the_layout_cheaply(monkeypatch):
    """Of a step's four switcher calls for a table, only the first converts, checks and
    plans the ids (comparing them with the last step's); the other three take its layout
    after one ``memcmp`` of numpy ids against the layout's own copy (numpy keeps no edit
    counter) and without reading tensor ids (their version counter). Copies of the ids,
    a numpy buffer refilled in place or a tensor edited in place are compared in full."""
    compared: list = []
    converted: list = []
    real_same, real_conv = SpeedTorch.same_ids, SpeedTorch.as_index_array
    monkeypatch.setattr(SpeedTorch, "same_ids", lambda a, b: compared.append(1) or real_same(a, b))
    monkeypatch.setattr(SpeedTorch, "as_index_array", lambda a: converted.append(1) or real_conv(a))
    p = torch.nn.Parameter(torch.zeros(2, 2))
    calls = ("model-before", "opt-before", "model-after", "opt-after")
    ids = np.array([[4, 1], [4, 7]])
    lay = SpeedTorch._layout_for(p, ids, None, 10, calls[0])
    converted.clear()
    for c in calls[1:]:
        assert SpeedTorch._layout_for(p, ids, None, 10, c) is lay
    assert compared == [1, 1, 1] and converted == []  # one memcmp each, no conversion
    ids[0, 0] = 9  # the next step: the buffer refilled in place
    compared.clear()
    nxt = SpeedTorch._layout_for(p, ids, None, 10, calls[0])
    assert nxt is not lay and nxt.unique.tolist() == [1, 4, 7, 9]
    compared.clear()
    converted.clear()
    assert SpeedTorch._layout_for(p, ids.copy(), None, 10, calls[1]) is nxt
    assert len(compared) == 1 and len(converted) == 1  # a copy: compared in full
    t = torch.tensor([[4, 1], [4, 7]])
    lay = SpeedTorch._layout_for(p, t, None, 10, calls[0])
    compared.clear()
    converted.clear()
    for c in calls[1:]:
        assert SpeedTorch._layout_for(p, t, None, 10, c) is lay
    assert compared == [] and converted == []  # tensors: the version counter only
    t[0, 0] = 9  # an edit torch counts: compared, and a new layout
    lay = SpeedTorch._layout_for(p, t, None, 10, calls[0])
    assert SpeedTorch._layout_for(p, t, None, 10, calls[1]).unique.tolist() == [1, 4, 7, 9]


@pytest.mark.parametrize("kinds", ["numpy", "numpy+tensor", "tensor+numpy"])
def test_layout_shortcut_sees_numpy_ids_refilled_between_calls(kinds):
    """The shortcut for a later call of a step takes the last layout only while the very
    same id objects still hold its ids: a numpy buffer refilled in place before a call
    not yet made on the layout gets the layout of its new ids (numpy ids have no edit
    counter, so identity alone proved nothing; regression: the old ids' layout came
    back)."""
    p = torch.nn.Parameter(torch.zeros(2, 2))
    pos = np.array([[4, 1], [2, 7]])
    neg = np.array([3, 5])
    if kinds == "numpy+tensor":
        neg = torch.as_tensor(neg)
    elif kinds == "tensor+numpy":
        pos = torch.as_tensor(pos)
    first = SpeedTorch._layout_for(p, pos, neg, 30, "model-before")
    assert first.ids.tolist() == [4, 1, 2, 7, 3, 5]
    target = pos if isinstance(pos, np.ndarray) else neg  # a numpy part
    target[...] = np.arange(20, 20 + target.size).reshape(target.shape)  # refilled in place
    got = SpeedTorch._layout_for(p, pos, neg, 30, "opt-before")
    want = np.concatenate([np.asarray(pos).ravel(), np.asarray(neg).ravel()])
    assert got is not first
    assert got.ids.tolist() == want.tolist()
    # unchanged from here on: the later calls of the step take the new layout
    assert SpeedTorch._layout_for(p, pos, neg, 30, "model-after") is got
    assert SpeedTorch._layout_for(p, pos, neg, 30, "opt-after") is got


def test_eval_pass_between_steps_with_one_refilled_id_buffer():
    """speedtorch_audit repro_stale_layout_reused_buffer: one numpy id buffer refilled in
    place; an evaluation batch goes through the model switcher only, then the next
    training step calls the optimizer switcher first. That call must install the state
    rows of the training ids (fresh rows: zeros), not the evaluation ids' (regression:
    their Adam state was installed, then written back onto the training ids' rows)."""
    torch.manual_seed(0)
    N, D, B = 50, 4, 4
    emb = torch.nn.Embedding(B, D)
    model = torch.nn.ModuleDict({"u": emb})
    us = SpeedTorch.ModelFactory(emb, N, D)
    us.uniformDistributionInit(-0.5, 0.5)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    uo = SpeedTorch.OptimizerFactory(opt, N, D, model, "u")
    uo.optInit()
    dummy = torch.arange(B)
    ids = np.empty(B, dtype=np.int64)  # one id buffer, refilled in place

    def train_step(new_ids):
        ids[:] = new_ids
        uo.beforeForwardPass(ids)  # the optimizer switcher first
        installed = {k: opt.state[emb.weight][k].clone() for k in ("exp_avg", "exp_avg_sq")}
        us.beforeForwardPass(ids)
        loss = (emb(dummy) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        us.afterOptimizerStep(ids)
        uo.afterOptimizerStep(ids)
        return installed

    train_step([0, 1, 2, 3])
    train_step([10, 11, 12, 13])
    ids[:] = [0, 1, 2, 3]  # the evaluation batch: the model switcher only
    us.beforeForwardPass(ids)
    with torch.no_grad():
        emb(dummy)
    before = uo.getNumpyVersion()
    installed = train_step([20, 21, 22, 23])
    after = uo.getNumpyVersion()
    for key in ("exp_avg", "exp_avg_sq"):
        np.testing.assert_array_equal(installed[key].numpy(), before[key][20:24], err_msg=key)
        # the rows of ids 0..3 are not touched by the step of ids 20..23
        np.testing.assert_array_equal(after[key][:4], before[key][:4], err_msg=key)
        assert np.abs(after[key][20:24]).sum() > 0, key


def test_moves_ask_fusable_once_per_stores_and_forget_them(monkeypatch):
    """A model switcher asks whether its table and its optimizer's state tables can move
    in one launch once, not per step; a new table (an initialiser) or new state tables
    (``optInit``) are asked about again, and a new table drops the launches prepared for
    the old one."""
    asked: list = []
    monkeypatch.setattr(SpeedTorch, "_fusable", lambda stores, device: asked.append(len(stores)) or False)
    model, sw, opt, osw, dummies = _pinned_pattern(
        "cpu", lambda ps: torch.optim.Adam(ps, lr=0.1), B=4, P=2, N=3, n_u=30, n_v=40, dim=8)
    rng = np.random.default_rng(0)

    def step():
        u, pos, neg = rng.integers(0, 30, 4), rng.integers(0, 40, (4, 2)), rng.integers(0, 40, (4, 3))
        _pattern_step(model, sw, opt, osw, dummies, u, pos, neg)

    for _ in range(5):
        step()
    assert asked == [3, 3]  # u and v: the weight and Adam's two state tables, once each
    osw[1].optInit()  # new state tables for v
    step()
    assert asked == [3, 3, 3]
    moves = sw[0]._moves
    moves._prepared[("gather", 0, 3, 0, 0)] = None  # stands for a prepared launch
    sw[0].zerosInit()  # a new u table: what was prepared for the old one is dropped
    assert moves._prepared == {} and moves.stores == ()
    step()
    assert asked == [3, 3, 3, 3]

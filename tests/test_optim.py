"""Optimizer-state offload: splitting, fresh-row values, references (SGD, SparseAdam, Adagrad)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from stpipe import StpipeRuntimeError, StpipeTypeError, StpipeValueError
from stpipe.embedding import HostEmbedding
from stpipe.optim import RowState, find_group, fresh_row_state, split_state
from stpipe.pipeline import Pipeline

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")

NUM_ROWS = 300
DIM = 16  # a multiple of every CPU vector width: no scalar tails, exact SGD comparison


def _param(k=5):
    p = torch.nn.Parameter(torch.randn(k, DIM))
    p.grad = torch.randn(k, DIM)
    return p


# (factory, {key: fresh value}) read from torch/optim/*.py
FRESH = {
    "sgd_momentum": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), {"momentum_buffer": 0.0}),
    "adam": (lambda p: torch.optim.Adam(p), {"exp_avg": 0.0, "exp_avg_sq": 0.0}),
    "adam_amsgrad": (lambda p: torch.optim.Adam(p, amsgrad=True),
                     {"exp_avg": 0.0, "exp_avg_sq": 0.0, "max_exp_avg_sq": 0.0}),
    "adamw": (lambda p: torch.optim.AdamW(p), {"exp_avg": 0.0, "exp_avg_sq": 0.0}),
    "adamax": (lambda p: torch.optim.Adamax(p), {"exp_avg": 0.0, "exp_inf": 0.0}),
    "nadam": (lambda p: torch.optim.NAdam(p), {"exp_avg": 0.0, "exp_avg_sq": 0.0}),
    "radam": (lambda p: torch.optim.RAdam(p), {"exp_avg": 0.0, "exp_avg_sq": 0.0}),
    "adagrad": (lambda p: torch.optim.Adagrad(p, initial_accumulator_value=0.25), {"sum": 0.25}),
    "adadelta": (lambda p: torch.optim.Adadelta(p), {"square_avg": 0.0, "acc_delta": 0.0}),
    "rmsprop_centered_momentum": (lambda p: torch.optim.RMSprop(p, centered=True, momentum=0.5),
                                  {"square_avg": 0.0, "momentum_buffer": 0.0, "grad_avg": 0.0}),
    "rprop": (lambda p: torch.optim.Rprop(p, lr=0.03), {"prev": 0.0, "step_size": 0.03}),
    "rprop_big_lr": (lambda p: torch.optim.Rprop(p, lr=80.0), {"prev": 0.0, "step_size": 80.0}),
    "asgd": (lambda p: torch.optim.ASGD(p), {"ax": 0.0}),
}


@pytest.mark.parametrize("name", list(FRESH))
def test_fresh_row_state_matches_torch_init(name):
    factory, want = FRESH[name]
    p = _param()
    opt = factory([p])
    got = fresh_row_state(opt, p)
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].shape == (DIM,)
        assert torch.equal(got[key], torch.full((DIM,), value)), key
    # and the split of the real state after a step agrees
    opt.step()
    per_row, scalar = split_state(opt, p)
    assert set(per_row) == set(want)
    assert all(opt.state[p][k].dim() == 0 or not torch.is_tensor(opt.state[p][k]) for k in scalar)


def test_split_state_scalars():
    p = _param()
    opt = torch.optim.ASGD([p])
    opt.step()
    per_row, scalar = split_state(opt, p)
    assert per_row == ("ax",)
    assert set(scalar) == {"step", "eta", "mu"}
    opt = torch.optim.NAdam([p])
    opt.step()
    assert "mu_product" in split_state(opt, p)[1]


def test_unsplittable_state_names_the_key():
    p = _param()
    opt = torch.optim.Adafactor([p])
    opt.step()
    with pytest.raises(StpipeValueError, match="'row_var'.*cannot be split by row"):
        split_state(opt, p)


def test_find_group_errors():
    p = _param()
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        find_group(object(), p)
    with pytest.raises(StpipeValueError, match="not among the parameters"):
        find_group(torch.optim.SGD([_param()], lr=0.1), p)


def test_row_state_snapshot_restore():
    p = _param()
    opt = torch.optim.ASGD([p], lr=0.1, t0=0)
    rs = RowState(opt, p, lambda key, dtype, row: None)
    assert rs.snapshot() is None
    opt.step()
    rs.restore(None)
    assert p not in opt.state
    opt.step()
    rs.discover()
    assert rs.keys == ("ax",)
    snap = rs.snapshot()
    eta, step = opt.state[p]["eta"].clone(), opt.state[p]["step"].clone()
    opt.step()
    assert not torch.equal(opt.state[p]["step"], step)
    rs.restore(snap)
    assert torch.equal(opt.state[p]["step"], step) and torch.equal(opt.state[p]["eta"], eta)


def test_row_state_snapshot_of_in_place_scalars_and_replaced_ones():
    """Adam's ``step`` is updated in place and read through a cached numpy view: every
    snapshot holds its own value, a restored (new) tensor is snapshotted afresh, and a
    dtype numpy cannot hold (bfloat16) is cloned."""
    p = _param()
    opt = torch.optim.Adam([p], lr=0.1)
    rs = RowState(opt, p, lambda key, dtype, row: None)
    opt.step()
    rs.discover()
    snaps = []
    for _ in range(3):
        snaps.append(rs.snapshot())
        opt.step()
    assert float(opt.state[p]["step"]) == 4.0
    rs.restore(snaps[1])
    assert float(opt.state[p]["step"]) == 2.0 and opt.state[p]["step"].dtype == torch.float32
    restored = opt.state[p]["step"]
    opt.step()
    snap = rs.snapshot()  # the restored tensor is another object: a new view
    opt.step()
    rs.restore(snap)
    assert float(opt.state[p]["step"]) == 3.0 and opt.state[p]["step"] is not restored
    opt.state[p]["step"] = torch.tensor(7.0, dtype=torch.bfloat16)
    snap = rs.snapshot()
    opt.state[p]["step"] += 1
    rs.restore(snap)
    assert opt.state[p]["step"].dtype == torch.bfloat16 and float(opt.state[p]["step"]) == 7.0


# -------------------------------------------------------------------------- references
def _batches(steps=30, seed=0, n=24):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy((rng.zipf(1.3, size=n) - 1) % NUM_ROWS) for _ in range(steps)]


COEF = torch.linspace(-1.0, 1.0, DIM)


def _loss(rows):
    return ((torch.tanh(rows) * COEF).sum(-1) - 0.5).pow(2).sum()


def _stpipe(make_opt, batches, depth=1):
    emb = HostEmbedding(NUM_ROWS, DIM, device="cpu", generator=torch.Generator().manual_seed(7))
    init = emb.table.tensor().clone()
    opt = make_opt(emb.parameters())
    with Pipeline(emb, optimizer=opt, depth=depth) as pipe:
        for step in pipe.run(batches):
            with step:
                _loss(emb(step.ids)).backward()
                opt.step()
                opt.zero_grad()
    return init, emb


def _reference(init, make_opt, batches, sparse):
    ref = torch.nn.Embedding(NUM_ROWS, DIM, sparse=sparse)
    with torch.no_grad():
        ref.weight.copy_(init)
    opt = make_opt(ref.parameters())
    for ids in batches:
        _loss(ref(ids)).backward()
        opt.step()
        opt.zero_grad()
    return ref, opt


@pytest.mark.parametrize("depth", [0, 1, 2], ids=lambda d: f"depth{d}")
def test_sgd_matches_nn_embedding_exactly(depth):
    batches = _batches()
    init, emb = _stpipe(lambda p: torch.optim.SGD(p, lr=0.05, foreach=False), batches, depth)
    ref, _ = _reference(init, lambda p: torch.optim.SGD(p, lr=0.05, foreach=False), batches, sparse=False)
    assert torch.equal(emb.table.tensor(), ref.weight.detach())


@pytest.mark.parametrize("depth", [0, 1], ids=lambda d: f"depth{d}")
def test_adam_matches_sparse_adam(depth):
    """stpipe + dense Adam vs nn.Embedding(sparse=True) + SparseAdam.

    Same maths, different operation order (SparseAdam updates the moments by
    ``add_((g - m) * (1 - beta))`` on coalesced values, Adam by ``lerp_``), so the tables agree
    to float32 rounding. Adam's normalised update ``m / (sqrt(v) + eps)`` amplifies the
    rounding of tiny moments, so the tolerance is rtol 1e-5, atol 1e-5 (a thousandth of one
    step of lr 1e-2) after 30 steps on values of order 1; in practice 99.8% of the elements
    agree to 2e-6.
    """
    batches = _batches()
    init, emb = _stpipe(lambda p: torch.optim.Adam(p, lr=0.01), batches, depth)
    ref, ropt = _reference(init, lambda p: torch.optim.SparseAdam(p, lr=0.01), batches, sparse=True)
    got = emb.table.tensor()
    assert not torch.equal(got, init)
    torch.testing.assert_close(got, ref.weight.detach(), rtol=1e-5, atol=1e-5)
    assert (got - ref.weight.detach()).abs().le(2e-6).float().mean() > 0.99
    st = ropt.state[ref.weight]
    torch.testing.assert_close(emb.state_tables["exp_avg"].tensor(), st["exp_avg"], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(emb.state_tables["exp_avg_sq"].tensor(), st["exp_avg_sq"], rtol=1e-4, atol=1e-7)
    # rows never in a batch are untouched (what SparseAdam gives)
    seen = torch.unique(torch.cat(batches))
    untouched = torch.ones(NUM_ROWS, dtype=torch.bool)
    untouched[seen] = False
    assert torch.equal(got[untouched], init[untouched])
    assert not emb.state_tables["exp_avg"].tensor()[untouched].any()


@pytest.mark.parametrize("depth", [0, 1], ids=lambda d: f"depth{d}")
def test_adagrad_matches_sparse_adagrad(depth):
    """Adagrad (dense, via stpipe) vs nn.Embedding(sparse=True) + Adagrad (sparse path).

    The sparse path computes ``sqrt`` of the masked sum and divides, the dense path uses
    ``addcdiv``: equal to float32 rounding (atol 2e-6).
    """
    batches = _batches()
    make = lambda p: torch.optim.Adagrad(p, lr=0.05, initial_accumulator_value=0.1)  # noqa: E731
    init, emb = _stpipe(make, batches, depth)
    ref, ropt = _reference(init, make, batches, sparse=True)
    torch.testing.assert_close(emb.table.tensor(), ref.weight.detach(), rtol=0, atol=2e-6)
    torch.testing.assert_close(emb.state_tables["sum"].tensor(), ropt.state[ref.weight]["sum"],
                               rtol=1e-6, atol=1e-6)


def test_fresh_rows_get_fresh_state_in_tables():
    """Rows never trained keep the fresh value in their state tables (Rprop: lr)."""
    batches = _batches(steps=5)
    _, emb = _stpipe(lambda p: torch.optim.Rprop(p, lr=0.02), batches)
    seen = torch.unique(torch.cat(batches))
    untouched = torch.ones(NUM_ROWS, dtype=torch.bool)
    untouched[seen] = False
    step_size = emb.state_tables["step_size"].tensor()
    assert torch.all(step_size[untouched] == torch.tensor(0.02))
    assert not torch.all(step_size[seen] == torch.tensor(0.02))


class _EagerAccumulator(torch.optim.Optimizer):
    """Creates its per-row state in ``__init__`` and needs it in ``step`` (like torch 2.11's
    Adagrad, whose ``step`` raises ``KeyError: 'sum'`` on a parameter with no state)."""

    def __init__(self, params, lr=0.1, initial=0.5):
        super().__init__(params, dict(lr=lr, initial=initial))
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["acc"] = torch.full_like(p, group["initial"])
                self.state[p]["step"] = torch.tensor(0.0)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                acc = state["acc"]  # KeyError when the state was not created in __init__
                state["step"] += 1
                acc.add_(p.grad * p.grad)
                p.sub_(group["lr"] * p.grad / acc.sqrt())


def test_fresh_row_state_of_optimizer_with_eager_state():
    p = torch.nn.Parameter(torch.zeros(3, 4))
    opt = _EagerAccumulator([p], initial=0.25)
    fresh = fresh_row_state(opt, p, keys=["acc"])
    torch.testing.assert_close(fresh["acc"], torch.full((4,), 0.25))


def test_pipeline_trains_optimizer_with_eager_state():
    emb = HostEmbedding(num_rows=50, dim=4, init="normal")
    opt = _EagerAccumulator(emb.parameters(), initial=0.25)
    batches = [{"ids": torch.tensor([1, 2, 2])}, {"ids": torch.tensor([2, 7])}]
    with Pipeline(emb, optimizer=opt, ids=lambda b: b["ids"], depth=1) as pipe:
        for step in pipe.run(batches):
            with step:
                emb(step.ids).sum().backward()
                opt.step()
                opt.zero_grad()
    acc = emb.state_tables["acc"].tensor()
    # row 7 first appears in the second batch: it starts from the fresh 0.25, gets grad 1
    torch.testing.assert_close(acc[7], torch.full((4,), 1.25))
    # row 2: grad 2 (twice in batch 1), then grad 1 (batch 2)
    torch.testing.assert_close(acc[2], torch.full((4,), 0.25 + 4.0 + 1.0))
    torch.testing.assert_close(acc[0], torch.full((4,), 0.25))  # never touched


def test_sparse_adam_on_a_table_is_refused_at_construction():
    """SparseAdam takes sparse gradients only; the working rows' are dense. The pipeline
    says so when it is built, not at the first ``opt.step()`` inside the user's step."""
    emb = HostEmbedding(num_rows=16, dim=4)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.01)
    with pytest.raises(StpipeTypeError, match=r"SparseAdam.*dense.*torch\.optim\.Adam.*got SparseAdam"):
        Pipeline(emb, optimizer=opt)
    with pytest.raises(StpipeTypeError, match="SparseAdam"):
        emb.bind_optimizer(opt)


def test_lbfgs_and_a_table_in_two_optimizers_are_refused_at_construction():
    """LBFGS keeps one flat state over all its parameters, under the first (regression:
    with a dense layer first it was accepted and mixed rows' curvature history); a
    table's weight in two of the given optimizers is refused (regression: only the
    first one's state travelled with the rows, the other's stayed by position)."""
    emb = HostEmbedding(num_rows=16, dim=4)
    head = torch.nn.Linear(4, 1)
    lbfgs = torch.optim.LBFGS([*head.parameters(), emb.weight], lr=0.1)
    with pytest.raises(StpipeTypeError, match=r"LBFGS.*'d'.*split by row.*got LBFGS"):
        Pipeline(emb, optimizer=lbfgs)
    a, b = torch.optim.Adam(emb.parameters()), torch.optim.SGD(emb.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(StpipeValueError, match=r"in optimizers \[0, 1\].*one optimizer per table"):
        Pipeline(emb, optimizer=[a, b])
    Pipeline(emb, optimizer=[torch.optim.SGD(head.parameters(), lr=0.1), a]).close()  # one each: fine


@pytest.mark.parametrize("reset", ["clear", "load_fresh"])
def test_optimizer_state_reset_mid_run_is_a_clear_error(reset):
    """``optimizer.state.clear()`` or loading a fresh optimizer's ``state_dict`` mid-run
    leaves the pipeline's host state tables without the optimizer's scalar state: the
    next step is refused at entry with stpipe's error naming the checkpoint loads
    (regression: Adam's own ``KeyError: 'step'`` at the next ``opt.step()``), and the
    tables are as the last step left them."""
    emb = HostEmbedding(num_rows=16, dim=4, device="cpu")
    opt = torch.optim.Adam(emb.parameters(), lr=0.1)
    fresh = torch.optim.Adam(HostEmbedding(num_rows=16, dim=4, device="cpu").parameters()).state_dict()
    batches = [torch.tensor([0, 1, 2]), torch.tensor([3, 4]), torch.tensor([5])]
    with Pipeline(emb, optimizer=opt) as pipe:
        for step in pipe.run(batches):
            if step.index == 1:
                if reset == "clear":
                    opt.state.clear()
                else:
                    opt.load_state_dict(fresh)
                table = emb.table.tensor().clone()
                with pytest.raises(StpipeRuntimeError, match="holds no state.*load_checkpoint.*step 1 was not entered"):
                    with step:
                        pass
                assert torch.equal(emb.table.tensor(), table)
                break
            with step:
                emb(step.ids).sum().backward()
                opt.step()
                opt.zero_grad()


@pytest.mark.parametrize("make, refused", [
    (lambda p: torch.optim.Adam(p, lr=0.1), True),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), True),
    (lambda p: torch.optim.SGD(p, lr=0.1), False),
], ids=["Adam", "SGD-momentum", "SGD"])
def test_an_optimizer_with_row_state_not_given_to_the_pipeline_is_refused(make, refused):
    """A pipeline built without the optimizer that trains its table: a stateless one
    (plain SGD) trains as usual; one that keeps per-row state fails the step from its
    ``step()`` with stpipe's error naming the keys, and the table is unchanged
    (regression: the state stayed with the working rows' positions and went to other
    rows at the next step)."""
    emb = HostEmbedding(num_rows=16, dim=4, device="cpu", generator=torch.Generator().manual_seed(0))
    opt = make(emb.parameters())
    before = emb.table.tensor().clone()
    with Pipeline(emb) as pipe:
        for step in pipe.run([torch.tensor([0, 1, 2]), torch.tensor([5, 6, 7])]):
            if refused:
                with pytest.raises(StpipeRuntimeError, match=r"per-row state \['(exp_avg|momentum_buffer)'.*optimizer=opt"):
                    with step:
                        emb(step.ids).sum().backward()
                        opt.step()
                assert torch.equal(emb.table.tensor(), before)
                break
            with step:
                emb(step.ids).sum().backward()
                opt.step()
                opt.zero_grad()
    if not refused:
        changed = (emb.table.tensor() != before).any(1).nonzero().flatten().tolist()
        assert changed == [0, 1, 2, 5, 6, 7]


def test_sparse_adam_on_another_parameter_is_accepted():
    """Only an optimizer that trains a table is refused: a SparseAdam over the model's own
    ``nn.Embedding(sparse=True)`` beside it is the user's business and trains as usual."""
    torch.manual_seed(0)
    emb = HostEmbedding(num_rows=16, dim=4)
    side = torch.nn.Embedding(8, 4, sparse=True)
    side_before = side.weight.detach().clone()
    table_before = emb.table.tensor().clone()
    opt = torch.optim.Adam(emb.parameters(), lr=0.01)
    sopt = torch.optim.SparseAdam(side.parameters(), lr=0.01)
    batches = [torch.tensor([1, 2, 3]), torch.tensor([3, 4])]
    with Pipeline(emb, optimizer=[opt, sopt]) as pipe:
        for step in pipe.run(batches):
            with step:
                loss = emb(step.ids).sum() + side(step.ids % 8).sum()
                loss.backward()
                opt.step(); sopt.step()
                opt.zero_grad(); sopt.zero_grad()
    assert not torch.equal(side.weight.detach(), side_before)
    after = emb.table.tensor()
    assert not torch.equal(after[1:5], table_before[1:5])  # the batches' rows trained
    assert torch.equal(after[5:], table_before[5:]) and torch.equal(after[0], table_before[0])

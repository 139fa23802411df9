"""HostEmbedding: construction, lookup outside a step, forward/backward inside a step."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from stpipe import StpipeIndexError, StpipeTypeError, StpipeValueError
from stpipe.embedding import HostEmbedding
from stpipe.host import HostTable
from stpipe.pipeline import Pipeline

NUM_ROWS, DIM = 200, 16


def make(dtype=torch.float32, **kw):
    return HostEmbedding(NUM_ROWS, DIM, dtype, device="cpu", generator=torch.Generator().manual_seed(3), **kw)


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                                 ids=["f32", "f16", "bf16"])
INDEX_DTYPES = pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])


@DTYPES
def test_construction(dtype):
    emb = make(dtype)
    assert emb.num_rows == emb.num_embeddings == NUM_ROWS and emb.dim == emb.embedding_dim == DIM
    assert emb.dtype == dtype and emb.device == torch.device("cpu")
    assert [p.shape for p in emb.parameters()] == [(0, DIM)]
    assert emb.weight.dtype == dtype
    assert emb.state_tables == {}
    assert "200, 16" in repr(emb)


def test_initialisers():
    assert not make(init="zeros").table.tensor().any()
    u = make(init="uniform").table.tensor()
    assert u.abs().max() <= 1 / DIM ** 0.5
    n = make().table.tensor()
    assert 0.8 < float(n.std()) < 1.2
    emb = make(init=lambda t: t.init_(torch.nn.init.constant_, 0.5))
    assert torch.all(emb.table.tensor() == 0.5)
    # seeded: reproducible
    assert torch.equal(make().table.tensor(), make().table.tensor())


def test_wrap_existing_table():
    t = HostTable(NUM_ROWS, DIM, device="cpu").zeros_()
    emb = HostEmbedding(table=t)
    assert emb.table is t and emb.num_rows == NUM_ROWS
    with pytest.raises(StpipeValueError, match="does not match"):
        HostEmbedding(NUM_ROWS + 1, table=t)


@pytest.mark.parametrize(
    "kwargs, exc, msg",
    [
        (dict(num_rows=0, dim=4), StpipeValueError, "num_rows must be a positive int"),
        (dict(num_rows=10, dim=-1), StpipeValueError, "dim must be a positive int"),
        (dict(num_rows=10, dim=4, dtype=torch.float64), StpipeTypeError, "dtype must be"),
        (dict(num_rows=10, dim=4, init="xavier"), StpipeValueError, "init must be one of"),
        (dict(num_rows=10, dim=4, capacity=-1), StpipeValueError, "capacity"),
        (dict(num_rows=10), StpipeValueError, "needs num_rows and dim"),
    ],
    ids=["rows0", "dim_neg", "float64", "bad_init", "bad_capacity", "no_dim"],
)
def test_construction_errors(kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        HostEmbedding(device="cpu", **kwargs)


@DTYPES
@INDEX_DTYPES
def test_lookup_outside_step(dtype, index_dtype):
    emb = make(dtype)
    ids = torch.tensor([[5, 7, 5], [199, 0, 7]], dtype=index_dtype)
    out = emb(ids)
    assert out.shape == (2, 3, DIM) and out.dtype == dtype and not out.requires_grad
    assert torch.equal(out, emb.table.tensor()[ids.long()])
    assert torch.equal(emb.lookup(np.array([3])), emb.table.tensor()[[3]])


def test_lookup_bad_ids():
    emb = make()
    with pytest.raises(StpipeIndexError, match=r"row id 200 at position 1"):
        emb(torch.tensor([1, 200]))
    with pytest.raises(StpipeIndexError, match=r"row id -1"):
        emb([-1])
    with pytest.raises(StpipeTypeError, match="integer"):
        emb(torch.tensor([1.0]))


@INDEX_DTYPES
def test_gradient_sums_duplicates_like_nn_embedding(index_dtype):
    """Inside a step, the working rows' gradient equals nn.Embedding's, row for row."""
    emb = make()
    ref = torch.nn.Embedding(NUM_ROWS, DIM)
    with torch.no_grad():
        ref.weight.copy_(emb.table.tensor())
    ids = torch.tensor([[4, 9, 4], [4, 150, 9]], dtype=index_dtype)
    w = torch.randn(2, 3, DIM)
    with Pipeline(emb, depth=0) as pipe:
        for step in pipe.run([ids]):
            with step:
                out = emb(step.ids)
                assert torch.equal(out, ref(ids.long()))
                (out * w).sum().backward()
                grad = emb.weight.grad
                assert grad.shape == (3, DIM)  # rows 4, 9, 150
    (ref(ids.long()) * w).sum().backward()
    assert torch.equal(grad, ref.weight.grad[[4, 9, 150]])


def test_working_parameter_shapes_follow_steps():
    emb = make()
    seen = []
    with Pipeline(emb, depth=1) as pipe:
        for step in pipe.run([torch.tensor([1, 2, 3]), torch.tensor([5]), torch.tensor([], dtype=torch.long)]):
            with step:
                seen.append(tuple(emb.weight.shape))
                assert emb(step.ids).shape == (len(step.ids), DIM)
    assert seen == [(3, DIM), (1, DIM), (0, DIM)]
    # outside a step the forward reads the host table again
    assert torch.equal(emb(torch.tensor([1])), emb.table.tensor()[[1]])


def test_state_dict_excludes_the_table():
    emb = make()
    sd = emb.state_dict()
    assert "weight" not in sd
    emb.load_state_dict(sd)  # strict: round-trips
    model = torch.nn.Sequential(emb, torch.nn.Linear(DIM, 2))
    assert set(model.state_dict()) == {"1.weight", "1.bias"}


def test_load_state_dict_keeps_nn_modules_rules():
    """Loading follows nn.Module's rules but for the transient weight (regression: the
    override skipped them): a subclass's buffer loads, a missing buffer or an unknown key
    under the module's prefix fails a strict load, load pre-hooks run; an nn.Embedding
    checkpoint's ``weight`` is an unexpected key (the table loads by
    ``emb.table.copy_from``), failing a strict load."""

    class Scaled(HostEmbedding):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.register_buffer("scale", torch.ones(1))

    src, dst = Scaled(20, DIM, device="cpu"), Scaled(20, DIM, device="cpu")
    src.scale.fill_(2.0)
    seen = []
    dst._register_load_state_dict_pre_hook(lambda *a, **k: seen.append(1))
    assert set(src.state_dict()) == {"scale"}
    dst.load_state_dict(src.state_dict())
    assert float(dst.scale) == 2.0 and seen == [1]
    with pytest.raises(RuntimeError, match="Missing key.*scale"):
        dst.load_state_dict({})
    model = torch.nn.Sequential(make(), torch.nn.Linear(DIM, 2))
    with pytest.raises(RuntimeError, match="Unexpected key.*0.wieght"):
        model.load_state_dict({**model.state_dict(), "0.wieght": torch.zeros(1)})
    other = torch.nn.Sequential(torch.nn.Embedding(20, DIM), torch.nn.Linear(DIM, 2)).state_dict()
    with pytest.raises(RuntimeError, match=r"Unexpected key.*0\.weight"):
        model.load_state_dict(other)
    result = model.load_state_dict(other, strict=False)
    assert result.unexpected_keys == ["0.weight"] and result.missing_keys == []
    assert torch.equal(model[1].weight, other["1.weight"])


def test_capacity_hint_and_growth():
    emb = make(capacity=64)
    with Pipeline(emb, depth=1) as pipe:
        for step in pipe.run([torch.arange(10), torch.arange(100), torch.arange(5)]):
            with step:
                assert emb.weight.shape[0] == len(step.ids)
                base = emb.weight.untyped_storage().nbytes() // (DIM * 4)
                assert base >= max(64, len(step.ids))


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_scalar_ids_give_one_row_like_nn_embedding(depth):
    """A 0-d id is looked up as ``(dim,)``, like nn.Embedding, in and out of a step, alone
    or as one part of a batch's ids; training on it matches nn.Embedding + SGD exactly."""
    emb = make()
    ref = torch.nn.Embedding(NUM_ROWS, DIM)
    with torch.no_grad():
        ref.weight.copy_(emb.table.tensor())
    assert emb(torch.tensor(5)).shape == (DIM,) and emb(7).shape == (DIM,)
    assert emb(np.int32(9)).shape == (DIM,)
    assert torch.equal(emb(torch.tensor(5)), ref(torch.tensor(5)).detach())
    opt = torch.optim.SGD(emb.parameters(), lr=0.5)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
    batches = [torch.tensor(5), torch.tensor(5), torch.tensor(199, dtype=torch.int32), torch.tensor(0)]
    w = torch.randn(len(batches), DIM, generator=torch.Generator().manual_seed(1))
    with Pipeline(emb, optimizer=opt, depth=depth) as pipe:
        for i, step in enumerate(pipe.run(batches)):
            with step:
                out = emb(step.ids)
                assert out.shape == (DIM,) == emb(step.ids.clone()).shape
                (out * w[i]).sum().backward()
                opt.step()
                opt.zero_grad()
    for i, ids in enumerate(batches):
        (ref(ids.long()) * w[i]).sum().backward()
        ropt.step()
        ropt.zero_grad()
    assert torch.equal(emb.table.tensor(), ref.weight.detach())
    # a scalar as one part of the batch's ids
    with Pipeline(emb, depth=depth, ids=lambda b: [b, torch.tensor([[1, 5]])]) as pipe:
        for step in pipe.run([torch.tensor(3)]):
            with step:
                a, b = step.ids
                assert emb(a).shape == (DIM,) and emb(b).shape == (1, 2, DIM)
                assert torch.equal(emb(a), ref.weight.detach()[3])


@pytest.mark.parametrize("depth", [0, 1])
def test_ids_edited_in_place_inside_a_step_are_looked_up_anew(depth):
    """``step.ids`` edited in place before the lookup (masking ``ids[m] = MASK``) gives
    the rows of the ids as they are now, with their gradients, when the step gathered
    those rows, and stpipe's error naming the edit when it did not (regression: the
    plan's inverse of the old values was taken, silently giving the old rows)."""
    from stpipe import StpipeValueError
    from stpipe.pipeline import Pipeline

    emb = HostEmbedding(10, 4, device="cpu", generator=torch.Generator().manual_seed(0))
    table = emb.table.tensor().clone()
    opt = torch.optim.SGD(emb.parameters(), lr=1.0)
    batches = [torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[1, 2, 3], [4, 5, 6]])]
    with Pipeline(emb, optimizer=opt, depth=depth) as pipe:
        for i, step in enumerate(pipe.run(batches)):
            with step:
                ids = step.ids
                if i == 0:
                    ids[:, 1] = 6  # among the step's rows: looked up as it is now
                    out = emb(ids)
                    assert torch.equal(out.detach(), table[ids])
                    out.sum().backward()
                    opt.step()
                    opt.zero_grad()
                else:
                    ids[0, 0] = 9  # not among them: an error that names the edit
                    with pytest.raises(StpipeValueError, match="edited in place"):
                        emb(ids)
    want = table.clone()
    for r, n in ((1, 1), (3, 1), (4, 1), (6, 3)):  # each use of a row subtracts 1 (lr 1)
        want[r] -= n
    assert torch.equal(emb.table.tensor(), want)


def test_module_conversions_to_another_dtype_or_device_are_refused():
    """``model.half()``, ``.double()``, ``.to(dtype)``, ``.to(device)`` with a
    HostEmbedding inside raise stpipe's TypeError naming dtype=/device= (regression:
    only the working parameter was converted; lookups kept the table's dtype and
    device); conversions to its own dtype and device are no-ops."""
    from stpipe import StpipeTypeError

    emb = make()
    model = torch.nn.Sequential(emb, torch.nn.Linear(DIM, 2))
    for convert in (lambda m: m.half(), lambda m: m.double(), lambda m: m.to(torch.bfloat16),
                    lambda m: m.to("meta")):
        with pytest.raises(StpipeTypeError, match="dtype= and device="):
            convert(model)
        assert emb.weight.dtype == emb.dtype == torch.float32 and emb.weight.device.type == "cpu"
    assert model.float() is model and model.to("cpu", torch.float32) is model
    assert emb(torch.tensor([1, 2])).dtype == torch.float32


def test_out_of_range_ids_inside_a_step_are_an_index_error():
    """Inside a step, ids that are no row at all (negative, >= num_rows) get the range
    error every other path gives, naming value and position; an in-range id the step
    did not gather stays the ValueError that says so."""
    from stpipe import StpipeIndexError, StpipeValueError
    from stpipe.pipeline import Pipeline

    emb = make()
    with Pipeline(emb, depth=0) as pipe:
        for step in pipe.run([torch.tensor([1, 2, 3])]):
            with step:
                with pytest.raises(StpipeIndexError, match=r"row id -1 at position 1 is out of range"):
                    emb(torch.tensor([2, -1]))
                with pytest.raises(StpipeIndexError, match=rf"row id {NUM_ROWS} at position 0"):
                    emb(torch.tensor([NUM_ROWS]))
                with pytest.raises(StpipeValueError, match="not among this step's rows"):
                    emb(torch.tensor([4]))

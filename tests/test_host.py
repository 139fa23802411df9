"""Tests of stpipe.host.HostTable on the CPU path (no GPU needed)."""
from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

from stpipe import BackendUnavailableError, StpipeError, StpipeRuntimeError
from stpipe.host import HostTable

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["f32", "f16", "bf16"]
CPU = {"device": "cpu", "pin": False}


def make(num_rows=50, dim=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return HostTable(num_rows, dim, dtype, **CPU).uniform_(-1, 1, generator=g)


# -- construction ---------------------------------------------------------------------
def test_attributes():
    t = HostTable(10, 3, "float16", **CPU)
    assert (t.num_rows, t.dim, t.dtype) == (10, 3, torch.float16)
    assert t.nbytes == 10 * 3 * 2 and t.device == torch.device("cpu")
    assert not t.pinned and not t.closed and t.backend == "auto"
    assert t.tensor().shape == (10, 3) and t.tensor().dtype == torch.float16
    assert "HostTable(num_rows=10" in repr(t)


def test_default_device_and_pin_follow_cuda():
    t = HostTable(4, 2)
    if torch.cuda.is_available():
        assert t.device.type == "cuda" and t.pinned
    else:
        assert t.device == torch.device("cpu") and not t.pinned


@pytest.mark.parametrize(
    "args, kwargs, exc",
    [
        ((0, 4), {}, ValueError),
        ((4, -1), {}, ValueError),
        ((4.0, 4), {}, TypeError),
        ((True, 4), {}, TypeError),
        ((4, 4, torch.float64), {}, TypeError),
        ((4, 4, torch.int32), {}, TypeError),
        ((4, 4, "float8"), {}, TypeError),
        ((4, 4), {"backend": "jax"}, ValueError),
        ((4, 4), {"device": "mps"}, ValueError),
        ((4, 4), {"device": "bogus"}, ValueError),
    ],
    ids=["zero-rows", "neg-dim", "float-rows", "bool-rows", "f64", "int32", "bad-name",
         "backend", "device", "device-name"],
)
def test_bad_construction(args, kwargs, exc):
    with pytest.raises(exc) as info:
        HostTable(*args, **{**CPU, **kwargs})
    assert isinstance(info.value, StpipeError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_cuda_requests_without_cuda():
    with pytest.raises(BackendUnavailableError, match="CUDA"):
        HostTable(4, 4, device="cuda")
    with pytest.raises(BackendUnavailableError, match="pin=True"):
        HostTable(4, 4, device="cpu", pin=True)


def test_memory_is_page_aligned_exact_size():
    t = HostTable(1000, 17, torch.float16, **CPU)
    assert t.tensor().data_ptr() % 4096 == 0
    assert t.tensor().untyped_storage().nbytes() <= t.nbytes + 2 * 4096


# -- initialisers ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_zeros_uniform_normal(dtype):
    t = HostTable(300, 5, dtype, **CPU)
    assert t.zeros_() is t and torch.count_nonzero(t.tensor()) == 0
    g = torch.Generator().manual_seed(1)
    x = t.uniform_(-0.5, 0.25, generator=g).tensor().float()
    assert x.min() >= -0.5 and x.max() <= 0.25 and x.std() > 0.1
    y = t.normal_(2.0, 0.5, generator=torch.Generator().manual_seed(2)).tensor().float()
    assert abs(y.mean().item() - 2.0) < 0.1 and abs(y.std().item() - 0.5) < 0.1
    with pytest.raises(ValueError, match="std"):
        t.normal_(0.0, -1.0)


def test_uniform_is_deterministic_with_generator(monkeypatch):
    import stpipe.host as host

    monkeypatch.setattr(host, "_CHUNK_BYTES", 64 * 4)  # many chunks
    a = HostTable(100, 16, **CPU).uniform_(generator=torch.Generator().manual_seed(5))
    b = HostTable(100, 16, **CPU).uniform_(generator=torch.Generator().manual_seed(5))
    assert torch.equal(a.tensor(), b.tensor())
    assert len(a._row_chunks()) == 25


def test_init_uses_whole_table_fans(monkeypatch):
    import stpipe.host as host

    monkeypatch.setattr(host, "_CHUNK_BYTES", 8192)
    n, dim = 4000, 32
    t = HostTable(n, dim, **CPU).init_(torch.nn.init.xavier_uniform_,
                                       generator=torch.Generator().manual_seed(0))
    bound = (6.0 / (n + dim)) ** 0.5
    x = t.tensor()
    assert x.abs().max() <= bound and x.abs().max() > 0.9 * bound
    t.init_(torch.nn.init.kaiming_normal_)
    assert abs(x.std().item() - (2.0 / dim) ** 0.5) < 0.02  # fan_in = dim
    t.init_(torch.nn.init.constant_, 0.25)
    assert torch.all(x == 0.25)
    t.init_(torch.nn.init.trunc_normal_, std=0.02, a=-0.03, b=0.03)
    assert x.abs().max() <= 0.03 and x.std() > 0.005


@pytest.mark.parametrize("fn", [torch.nn.init.orthogonal_, torch.nn.init.eye_, torch.nn.init.dirac_],
                         ids=["orthogonal", "eye", "dirac"])
def test_init_refuses_non_elementwise(fn):
    t = HostTable(20, 4, **CPU).zeros_()
    with pytest.raises(ValueError, match="copy_from") as info:
        t.init_(fn)
    assert isinstance(info.value, StpipeError)
    assert torch.count_nonzero(t.tensor()) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_copy_from_and_from_tensor(dtype):
    src = torch.randn(30, 7).to(dtype)
    t = HostTable.from_tensor(src, **CPU)
    assert t.dtype == dtype and torch.equal(t.tensor(), src)
    src2 = torch.randn(30, 7, dtype=torch.float64)
    t.copy_from(src2)
    assert torch.equal(t.tensor(), src2.to(dtype))
    with pytest.raises(ValueError, match=r"expected shape \(30, 7\), got \(7, 30\)"):
        t.copy_from(src2.T)
    with pytest.raises(TypeError):
        t.copy_from(np.zeros((30, 7), dtype=np.int64))
    with pytest.raises(TypeError):
        t.copy_from([[1.0] * 7] * 30)
    # any float dtype numpy has: other byte order, longdouble (torch takes neither)
    for np_dtype in (">f4", ">f8", np.longdouble):
        a = np.arange(210, dtype=np_dtype).reshape(30, 7)
        t.copy_from(a)
        assert torch.equal(t.tensor(), torch.arange(210, dtype=torch.float64).reshape(30, 7).to(dtype))


def test_cpu_0_is_the_cpu():
    t = HostTable(6, 2, device="cpu:0", pin=False).zeros_()
    assert t.device == torch.device("cpu")
    t.scatter([1], torch.ones(1, 2))
    out = torch.empty(1, 2)
    t.gather([1], out=out)
    assert out.tolist() == [[1.0, 1.0]] and t.gather([1]).device == torch.device("cpu")


def test_read_only_ids_do_not_warn():
    """Ids from np.frombuffer / a read-only memmap: torch warns when it wraps those;
    nothing writes through ids, so the table copies them instead."""
    import warnings

    t = HostTable(10, 2, **CPU).zeros_()
    ids = np.frombuffer(np.array([1, 3], dtype=np.int64).tobytes(), dtype=np.int64)
    assert not ids.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t.scatter(ids, torch.ones(2, 2))
        assert t.gather(ids).tolist() == [[1.0, 1.0]] * 2


@pytest.mark.parametrize("np_dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_from_numpy_copy_and_wrap(np_dtype):
    arr = np.random.default_rng(0).standard_normal((40, 9)).astype(np_dtype)
    copied = HostTable.from_numpy(arr, **CPU)
    wrapped = HostTable.from_numpy(arr, copy=False, **CPU)
    assert np.array_equal(copied.numpy(), arr) and np.array_equal(wrapped.numpy(), arr)
    arr[0, 0] = 42
    assert wrapped.numpy()[0, 0] == 42 and copied.numpy()[0, 0] != 42
    wrapped.scatter([1], torch.full((1, 9), 7.0, dtype=copied.dtype))
    assert np.all(arr[1] == 7)


def test_from_numpy_bad():
    with pytest.raises(TypeError):
        HostTable.from_numpy(np.zeros((3, 3), dtype=np.float64), **CPU)
    with pytest.raises(ValueError, match="2-d"):
        HostTable.from_numpy(np.zeros(3, dtype=np.float32), **CPU)
    with pytest.raises(ValueError, match="C-contiguous"):
        HostTable.from_numpy(np.zeros((3, 4), dtype=np.float32).T, copy=False, **CPU)
    with pytest.raises(TypeError):
        HostTable.from_numpy(torch.zeros(3, 3), **CPU)
    with pytest.raises(TypeError, match="unexpected keyword"):
        HostTable.from_numpy(np.zeros((3, 3), dtype=np.float32), copy=False, dev="cpu")
    with pytest.raises(ValueError, match="contiguous CPU"):
        HostTable.from_tensor(torch.zeros(3, 4).T, copy=False, **CPU)


def test_numpy_of_bfloat16_names_tensor():
    t = HostTable(3, 3, torch.bfloat16, **CPU)
    with pytest.raises(TypeError, match=r"tensor\(\)"):
        t.numpy()


# -- save / load ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dim", [1, 3, 17])
def test_save_load_round_trip(tmp_path, dtype, dim, monkeypatch):
    import stpipe.host as host

    monkeypatch.setattr(host, "_CHUNK_BYTES", 100)  # many I/O chunks, unaligned
    t = make(61, dim, dtype)
    path = tmp_path / "t.npy"
    t.save(path)
    assert os.listdir(tmp_path) == ["t.npy"]  # no temporary left behind
    u = HostTable.load(path, **CPU)
    assert (u.num_rows, u.dim, u.dtype) == (61, dim, dtype)
    assert torch.equal(u.tensor().view(torch.uint8), t.tensor().view(torch.uint8))
    arr = np.load(path, allow_pickle=False)
    if dtype == torch.bfloat16:
        assert arr.dtype == np.uint16  # documented convention: raw bfloat16 bits
        assert np.array_equal(arr.view(np.int16), t.tensor().view(torch.int16).numpy())
    else:
        assert np.array_equal(arr, t.numpy())
    with pytest.raises(TypeError, match="expected a"):
        HostTable.load(path, dtype=torch.float16 if dtype != torch.float16 else torch.float32,
                       **CPU)


def test_load_np_save_file(tmp_path):
    arr = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.save(tmp_path / "a.npy", arr)
    assert np.array_equal(HostTable.load(tmp_path / "a.npy", **CPU).numpy(), arr)
    np.save(tmp_path / "f.npy", np.asfortranarray(arr))
    with pytest.raises(ValueError, match="fortran"):
        HostTable.load(tmp_path / "f.npy", **CPU)


def test_save_replaces_atomically(tmp_path):
    path = tmp_path / "t.npy"
    make(5, 2, seed=1).save(path)
    t = make(5, 2, seed=2)
    t.save(path)
    assert np.array_equal(np.load(path), t.numpy())
    assert sorted(os.listdir(tmp_path)) == ["t.npy"]


def test_save_failure_leaves_old_file(tmp_path, monkeypatch):
    path = tmp_path / "t.npy"
    old = make(5, 2, seed=1)
    old.save(path)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        make(5, 2, seed=2).save(path)
    monkeypatch.undo()
    assert np.array_equal(np.load(path), old.numpy())
    assert sorted(os.listdir(tmp_path)) == ["t.npy"]


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    "kind, exc, match",
    [
        ("truncated", ValueError, "does not match its header"),
        ("extra", ValueError, "does not match its header"),
        ("not-npy", ValueError, "not a .npy file"),
        ("bad-header", ValueError, "header"),
        ("version-3", ValueError, r"version \(3, 0\) not supported"),
        ("float64", TypeError, "<f4"),
        ("int32", TypeError, "<f4"),
        ("big-endian", TypeError, "<f4"),
        ("1-d", ValueError, "2-d"),
        ("3-d", ValueError, "2-d"),
        ("empty", ValueError, "2-d"),
        ("object", TypeError, "unpickling"),
        ("structured", TypeError, "<f4"),
    ],
)
def test_load_refuses_bad_files(tmp_path, kind, exc, match):
    path = tmp_path / "bad.npy"
    good = np.ones((4, 3), dtype=np.float32)
    if kind in ("truncated", "extra"):
        np.save(path, good)
        raw = path.read_bytes()
        _write(path, raw[:-5] if kind == "truncated" else raw + b"\0" * 4)
    elif kind == "not-npy":
        _write(path, b"hello world, not numpy" * 10)
    elif kind == "bad-header":
        np.save(path, good)
        raw = bytearray(path.read_bytes())
        raw[12:20] = b"@@@@@@@@"
        _write(path, bytes(raw))
    elif kind == "version-3":
        np.save(path, good)
        raw = bytearray(path.read_bytes())
        raw[6] = 3  # the major version byte after b"\x93NUMPY"
        _write(path, bytes(raw))
    elif kind == "object":
        np.save(path, np.array([[{"x": 1}, None]], dtype=object), allow_pickle=True)
    else:
        arr = {
            "float64": good.astype(np.float64),
            "int32": good.astype(np.int32),
            "big-endian": good.astype(">f4"),
            "1-d": good.reshape(-1),
            "3-d": good.reshape(2, 2, 3),
            "empty": np.ones((0, 3), dtype=np.float32),
            "structured": np.zeros((4, 3), dtype=[("a", "<f4")]),
        }[kind]
        np.save(path, arr)
    with pytest.raises(exc, match=match) as info:
        HostTable.load(path, **CPU)
    assert isinstance(info.value, StpipeError)


def test_load_failure_closes_table(tmp_path, monkeypatch):
    path = tmp_path / "t.npy"
    make(10, 4).save(path)
    made = []
    orig_init = HostTable.__init__

    def spy(self, *a, **k):
        orig_init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(HostTable, "__init__", spy)
    import stpipe.host as host

    class Short:  # a file whose data ends right after the header
        def __init__(self, f):
            self.f = f

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def readinto(self, buf):
            return 0

    monkeypatch.setattr(host, "open", lambda p, mode: Short(open(p, mode)), raising=False)
    with pytest.raises(ValueError, match="truncated"):
        HostTable.load(path, **CPU)
    assert len(made) == 1 and made[0].closed


# -- movement (CPU path) --------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dim", [1, 3, 17, 129])
def test_gather_scatter_match_indexing(dtype, dim):
    t = make(97, dim, dtype)
    ref = t.tensor().clone()
    rng = np.random.default_rng(dim)
    for ids in (np.array([], dtype=np.int64), np.array([5]), np.arange(97),
                rng.permutation(97)[:40], np.sort(rng.permutation(97)[:40]).astype(np.int32)):
        got = t.gather(ids)
        assert got.shape == (len(ids), dim) and got.dtype == dtype
        assert torch.equal(got, ref[torch.from_numpy(ids.astype(np.int64))])
        new = torch.randn(len(ids), dim).to(dtype)
        t.scatter(ids, new)
        ref[torch.from_numpy(ids.astype(np.int64))] = new
        assert torch.equal(t.tensor(), ref)


def test_gather_accepts_lists_tensors_and_out():
    t = make(20, 4)
    ref = t.tensor()[[3, 1]]
    assert torch.equal(t.gather([3, 1]), ref)
    assert torch.equal(t.gather(torch.tensor([3, 1])), ref)
    assert torch.equal(t.gather(torch.tensor([3, 1], dtype=torch.int32)), ref)
    out = torch.full((2, 4), float("nan"))
    assert t.gather(np.array([3, 1]), out=out) is out and torch.equal(out, ref)


def test_bad_ids():
    t = make(20, 4)
    rows = torch.zeros(2, 4)
    for op in (lambda ids: t.gather(ids), lambda ids: t.scatter(ids, rows)):
        with pytest.raises(IndexError, match=r"row id 20 at position 1.*num_rows=20"):
            op([3, 20])
        with pytest.raises(IndexError, match=r"row id -1 at position 0"):
            op(np.array([-1, 3]))
        with pytest.raises(TypeError, match="integer"):
            op(np.array([1.0, 2.0]))
        with pytest.raises(TypeError):
            op(np.array([True, False]))
        with pytest.raises(ValueError, match="1-d"):
            op(np.array([[1], [2]]))


def test_bad_rows_and_out():
    t = make(20, 4)
    with pytest.raises(ValueError, match=r"expected rows of shape \(2, 4\), got \(2, 5\)"):
        t.scatter([1, 2], torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"got \(3, 4\)"):
        t.scatter([1, 2], torch.zeros(3, 4))
    with pytest.raises(TypeError, match="expected rows of dtype torch.float32, got torch.float16"):
        t.scatter([1, 2], torch.zeros(2, 4, dtype=torch.float16))
    with pytest.raises(TypeError, match="torch.Tensor"):
        t.scatter([1, 2], np.zeros((2, 4), dtype=np.float32))
    with pytest.raises(ValueError, match="shape"):
        t.gather([1, 2], out=torch.zeros(3, 4))
    with pytest.raises(TypeError, match="dtype"):
        t.gather([1, 2], out=torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        t.gather([1, 2], out=torch.zeros(4, 2).T)
    if torch.cuda.is_available():  # pragma: no cover - GPU machines
        with pytest.raises(ValueError, match="expected rows on cpu"):
            t.scatter([1, 2], torch.zeros(2, 4, device="cuda"))


def test_scatter_duplicates():
    t = make(20, 4)
    before = t.tensor().clone()
    with pytest.raises(ValueError, match=r"id 3 twice \(positions 1 and 2\)"):
        t.scatter([1, 3, 3], torch.zeros(3, 4))  # sorted: adjacent compare
    with pytest.raises(ValueError, match=r"id 5 twice \(positions 0 and 2\)"):
        t.scatter([5, 1, 5], torch.zeros(3, 4))  # unsorted: the bitmap pass
    with pytest.raises(ValueError, match=r"id 9 twice \(positions 0 and 2\)"):
        t.scatter([9, 4, 9, 4], torch.zeros(4, 4))  # the first id seen again is named
    with pytest.raises(ValueError, match=r"id 6 twice \(positions 1 and 2\)"):
        t.scatter(np.array([0, 6, 6]), torch.zeros(3, 4))  # non-decreasing
    assert torch.equal(t.tensor(), before)  # nothing written
    t.scatter([5, 1], torch.ones(2, 4), assume_unique=True)
    assert torch.all(t.tensor()[[1, 5]] == 1)


def test_closed_table():
    t = make(10, 2)
    t.close()
    t.close()  # idempotent
    assert t.closed and "closed" in repr(t)
    for call in (lambda: t.gather([1]), lambda: t.scatter([1], torch.zeros(1, 2)),
                 t.tensor, t.numpy, t.zeros_, t.uniform_, t.normal_, t.synchronize,
                 lambda: t.init_(torch.nn.init.zeros_), lambda: t.save("/nonexistent/x.npy"),
                 lambda: t.copy_from(torch.zeros(10, 2))):
        with pytest.raises(StpipeRuntimeError, match="closed"):
            call()


def test_context_manager_and_gc():
    with HostTable(10, 2, **CPU) as t:
        t.zeros_()
    assert t.closed
    t = HostTable(10, 2, **CPU)
    del t
    gc.collect()


def test_view_outlives_close():
    t = make(10, 2)
    view = t.tensor()
    ref = view.clone()
    t.close()
    assert torch.equal(view, ref)  # memory kept alive by the view, no crash


def test_import_does_not_load_optional_backends():
    import subprocess
    import sys

    code = ("import sys, stpipe, stpipe.host, stpipe.kernels; "
            "bad = [m for m in ('cupy', 'numba') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)



def test_index_batch_is_trusted_but_range_checked():
    """A prebuilt IndexBatch (the pipeline's) skips re-validation, not the range check."""
    from stpipe.kernels import IndexBatch

    t = HostTable(100, 4, device="cpu", pin=False).uniform_(-1, 1)
    batch = IndexBatch(host=np.array([3, 5, 99], dtype=np.int64), is_sorted=True)
    assert t._ids(batch) is batch
    torch.testing.assert_close(t.gather(batch), t.tensor()[[3, 5, 99]])
    small = HostTable(50, 4, device="cpu", pin=False)
    with pytest.raises(IndexError, match="row id 99"):
        small.gather(batch)


def test_index_batch_checked_for_another_table_is_checked_again():
    """An IndexBatch range-checked against another row count gets this table's check."""
    import numpy as np
    from stpipe.kernels import IndexBatch

    t = HostTable(10, 2, device="cpu")
    bad = IndexBatch(host=np.array([3, 12], dtype=np.int64), checked_rows=20)
    with pytest.raises(IndexError, match="12"):
        t.gather(bad)
    ok = IndexBatch(host=np.array([3, 9], dtype=np.int64), checked_rows=10)
    assert t.gather(ok).shape == (2, 2)


def test_scatter_checks_repeats_of_an_index_batch_against_this_table():
    """An IndexBatch range-checked against a smaller table (or not at all) is checked for
    repeats over this table's rows: a repeat is a ValueError, distinct ids are written."""
    from stpipe.kernels import IndexBatch

    t = make(20, 2)
    dup = IndexBatch(host=np.array([15, 3, 15], dtype=np.int64), checked_rows=-1)
    with pytest.raises(ValueError, match=r"id 15 twice \(positions 0 and 2\)"):
        t.scatter(dup, torch.zeros(3, 2))
    other = IndexBatch(host=np.array([3, 1, 3], dtype=np.int64), checked_rows=5)
    with pytest.raises(ValueError, match=r"id 3 twice"):
        t.scatter(other, torch.zeros(3, 2))
    ok = IndexBatch(host=np.array([18, 2, 11], dtype=np.int64), checked_rows=12)
    t.scatter(ok, torch.ones(3, 2))
    assert torch.all(t.tensor()[[18, 2, 11]] == 1)


# -- cross-stream ordering bookkeeping (fake streams and events: no GPU needed) -------------
class _FakeStream:
    def __init__(self, handle):
        self.cuda_stream = handle
        self.waited = []

    def wait_event(self, ev):
        self.waited.append(ev)


class _FakeMover:
    uses_cpu = False
    needs_pinned = True


@pytest.mark.parametrize("write", [False, True])
def test_before_waits_only_for_other_streams(write):
    t = make()
    a, b, m = _FakeStream(11), _FakeStream(22), _FakeMover()
    t._before(m, a, write=write)  # nothing recorded yet: nothing to wait for
    assert a.waited == []
    t._after(m, a, write=True, ev="w_a")
    t._before(m, a, write=write)  # the same stream orders it already
    assert a.waited == []
    t._before(m, b, write=write)  # another stream waits for the write
    assert b.waited == ["w_a"]
    t._after(m, b, write=False, ev="r_b")  # now a read on b as well
    a.waited.clear()
    t._before(m, a, write=True)  # a write on a waits for b's read
    assert a.waited == ["r_b"]
    a.waited.clear()
    t._before(m, a, write=False)  # a read on a needs only the write (on a itself)
    assert a.waited == []
    t._after(m, a, write=True, ev="w2_a")  # a write supersedes the reads
    b.waited.clear()
    t._before(m, a, write=True)
    assert a.waited == []
    t._before(m, b, write=True)
    assert b.waited == ["w2_a"]


def test_before_of_a_cpu_mover_waits_for_every_event():
    class Ev:
        def __init__(self):
            self.synced = 0

        def synchronize(self):
            self.synced += 1

    t = make()
    a = _FakeStream(11)
    gpu, cpu = _FakeMover(), _FakeMover()
    cpu.uses_cpu = True
    w = Ev()
    t._after(gpu, a, write=True, ev=w)
    t._before(cpu, a, write=False)  # host-side access: even the same stream's write
    assert w.synced == 1 and a.waited == []


def test_fused_move_launches_are_reused_per_geometry(monkeypatch):
    """``_move_many`` reuses a fused move's launch arguments for the same tables and plane
    geometry (any row count), and prepares anew for other tables or another geometry;
    the cache does not keep dropped tables alive."""
    import weakref

    import stpipe.host as host

    made = []

    class Prepared:
        def __init__(self, op, tables, planes):
            self._mover, self._launch = "mover", ("launch", planes.data_ptr(), planes.stride(0))
            made.append((op, len(tables)))

    monkeypatch.setattr(host, "_prepare_move", Prepared)
    monkeypatch.setattr(host, "_LAUNCHES", {})
    a, b = make(), make()
    buf = torch.empty(2, 40, 8)
    m1 = host._prepare_move_cached("gather", [a, b], buf[:, :10])
    m2 = host._prepare_move_cached("gather", [a, b], buf[:, :25])  # another row count
    assert len(made) == 1 and isinstance(m2, host._PreparedMove)
    assert m2._launch == m1._launch and m2.tables == [a, b]
    host._prepare_move_cached("scatter", [a, b], buf[:, :25])  # another op
    host._prepare_move_cached("gather", [b, a], buf[:, :25])  # other tables
    host._prepare_move_cached("gather", [a, b], torch.empty(2, 50, 8)[:, :10])  # other geometry
    assert len(made) == 4
    ref = weakref.ref(b)
    del b, m1, m2
    gc.collect()
    assert ref() is None  # the cache holds tables weakly


def test_pickle_and_deepcopy_are_refused_with_what_to_use_instead():
    """A table (and a model holding a HostEmbedding) is not pickled, deep-copied or
    torch.save-d: stpipe's TypeError names table.save and checkpoints (regression:
    Python's "cannot pickle '_thread.lock' object")."""
    import copy
    import io
    import pickle

    from stpipe import StpipeTypeError
    from stpipe.embedding import HostEmbedding

    table = HostTable(4, 3, **CPU)
    model = torch.nn.Sequential(HostEmbedding(table=table, device="cpu"), torch.nn.Linear(3, 1))
    for make in (lambda: pickle.dumps(table), lambda: copy.deepcopy(table),
                 lambda: copy.deepcopy(model), lambda: torch.save(model, io.BytesIO())):
        with pytest.raises(StpipeTypeError, match="table.save"):
            make()
    assert not table.closed and table.num_rows == 4  # the original is untouched

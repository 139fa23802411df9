"""GPU tests of HostTable's movement through every backend (run: ``pytest -m gpu``).

Every test here is marked ``gpu`` and skips cleanly without CUDA; a backend whose
package (CuPy, numba-cuda) is missing skips its cases.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from stpipe import BackendUnavailableError
from stpipe.host import HostTable
from stpipe.kernels import IndexBatch, get_backend

pytestmark = pytest.mark.gpu

BACKENDS = ["cupy", "numba", "torch", "auto"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["f32", "f16", "bf16"]
DIMS = [1, 3, 8, 17, 128, 129, 1024]
NUM_ROWS = 300


def need(backend: str) -> None:
    try:
        get_backend(backend)
    except BackendUnavailableError as exc:
        pytest.skip(f"backend {backend} unavailable: {exc}")


def random_bits(table: HostTable, seed: int) -> torch.Tensor:
    """Fill the table with random bytes (NaN payloads included); returns a CPU copy."""
    g = torch.Generator().manual_seed(seed)
    raw = table.tensor().view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    return table.tensor().clone()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def id_cases(n: int):
    rng = np.random.default_rng(n)
    return {
        "empty": np.array([], dtype=np.int64),
        "one": np.array([n - 1]),
        "all": np.arange(n),
        "random": np.sort(rng.choice(n, n // 3, replace=False)),
        "unsorted": rng.permutation(n)[: n // 2],
    }


@pytest.fixture(scope="module")
def tables():
    """One table per (backend, dtype, dim), reused across the id cases."""
    made = {}
    yield made
    for t in made.values():
        t.close()


def get_table(tables, backend, dtype, dim):
    key = (backend, dtype, dim)
    if key not in tables:
        tables[key] = HostTable(NUM_ROWS, dim, dtype, backend=backend)
    return tables[key]


@pytest.mark.parametrize("case", ["empty", "one", "all", "random", "unsorted"])
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_scatter_bit_exact(tables, backend, dtype, dim, case):
    need(backend)
    t = get_table(tables, backend, dtype, dim)
    assert t.pinned and t.device.type == "cuda"
    ref = random_bits(t, seed=dim)
    ids = id_cases(NUM_ROWS)[case]
    idx = torch.from_numpy(ids.astype(np.int64))
    rb = dim * t.itemsize
    # gather into NaN-poisoned output: every element must be overwritten
    out = torch.full((len(ids), dim), float("nan"), dtype=dtype, device="cuda")
    got = t.gather(ids, out=out)
    assert got is out
    torch.cuda.synchronize()
    ref_rows = bits(ref).view(NUM_ROWS, rb)  # raw bytes: indexing never touches NaNs
    want = ref_rows[idx].view(len(ids), rb)
    assert torch.equal(bits(got).view(len(ids), rb), want)
    # allocated output, ids given as a CUDA tensor
    got2 = t.gather(idx.cuda())
    assert got2.device.type == "cuda" and torch.equal(bits(got2).view(len(ids), rb), want)
    # scatter new bits, then read back through the host view and through gather
    g = torch.Generator().manual_seed(dim + 1)
    new = torch.randint(0, 256, (len(ids), dim * t.itemsize), generator=g, dtype=torch.uint8)
    new = new.view(dtype).cuda()
    t.scatter(ids, new)
    ref_rows[idx] = bits(new).view(len(ids), rb)
    assert torch.equal(bits(t.tensor()).view(NUM_ROWS, rb), ref_rows)
    assert torch.equal(bits(t.gather(ids)), bits(new))


@pytest.mark.parametrize("backend", BACKENDS)
def test_stream_ordering(backend):
    """Scatter on one stream, gather on another with no caller sync: sees the write;
    gather then scatter of the same rows: the gather keeps the old values."""
    need(backend)
    n, dim = 200_000, 64
    t = HostTable(n, dim, backend=backend).zeros_()
    ids = np.arange(0, n, 2)
    s1, s2, s3 = (torch.cuda.Stream() for _ in range(3))
    for it in range(3):
        with torch.cuda.stream(s1):
            rows = torch.full((len(ids), dim), float(it + 1), device="cuda")
        t.scatter(ids, rows, stream=s1)
        del rows  # kept alive by record_stream until the copy is done
        got = t.gather(ids, stream=s2)
        s3.wait_stream(s2)
        got.record_stream(s3)
        with torch.cuda.stream(s3):
            total = got.sum()
        s3.synchronize()
        assert total.item() == float(it + 1) * len(ids) * dim
    # write-after-read: a gather issued before a scatter returns the old rows
    before = t.gather(ids, stream=s1)
    t.scatter(ids, torch.full((len(ids), dim), -1.0, device="cuda"), stream=s2)
    torch.cuda.synchronize()
    assert torch.all(before == 3.0)
    assert torch.all(t.tensor()[ids] == -1.0)
    t.close()


@pytest.mark.parametrize("backend", ["cupy", "numba"])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_hybrid_split(backend, fraction):
    need(backend)
    from stpipe.kernels._auto import HybridBackend

    t = HostTable(1000, 33, torch.float16, backend=backend)
    ref = random_bits(t, 3)
    hyb = HybridBackend(get_backend(backend), get_backend("torch"), fraction)
    ids = np.sort(np.random.default_rng(0).choice(1000, 401, replace=False))
    s = torch.cuda.current_stream()
    out = torch.full((401, 33), float("nan"), dtype=torch.float16, device="cuda")
    hyb.gather(t.tensor(), IndexBatch(ids, is_sorted=True), out, s)
    torch.cuda.synchronize()
    want = bits(ref).view(1000, -1)[torch.from_numpy(ids)]
    assert torch.equal(bits(out).view(401, -1), want)
    new = torch.randn(401, 33, dtype=torch.float16, device="cuda")
    hyb.scatter(t.tensor(), IndexBatch(ids, is_sorted=True), new, s)
    torch.cuda.synchronize()
    assert torch.equal(bits(t.tensor()[ids]), bits(new))
    t.close()


def test_auto_records_a_decision():
    auto = get_backend("auto")
    t = HostTable(5000, 16, backend="auto").zeros_()
    t.gather(np.arange(0, 5000, 3))
    t.scatter(np.arange(0, 5000, 3), torch.ones(1667, 16, device="cuda"))
    assert torch.all(t.tensor()[::3] == 1) and torch.all(t.tensor()[1::3] == 0)
    ops = {key[0] for key in auto.decisions}
    assert {"gather", "scatter"} <= ops
    t.close()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_memory_outside_a_step():
    """A pinned table uses host memory at exact size and no GPU memory."""
    torch.cuda.synchronize()
    gpu0, rss0 = torch.cuda.memory_allocated(), _rss()
    t = HostTable(1_000_000, 128)  # 512 MB, page-locked
    rss = _rss() - rss0
    assert t.pinned
    assert torch.cuda.memory_allocated() == gpu0
    assert 0.95 * t.nbytes <= rss <= 1.05 * t.nbytes, (rss, t.nbytes)
    t.zeros_()
    assert torch.cuda.memory_allocated() == gpu0
    t.close()


def test_wrapped_numpy_is_registered_and_unregistered():
    arr = np.random.default_rng(0).standard_normal((777, 5)).astype(np.float32)
    for _ in range(2):  # registering the same memory twice must work after close()
        t = HostTable.from_numpy(arr, copy=False, backend="torch")
        assert t.pinned
        assert np.array_equal(t.gather([3, 776]).cpu().numpy(), arr[[3, 776]])
        t.close()


def test_bad_device_inputs():
    t = HostTable(10, 4)
    with pytest.raises(ValueError, match="expected rows on cuda"):
        t.scatter([1], torch.zeros(1, 4))
    with pytest.raises(ValueError, match="expected out on cuda"):
        t.gather([1], out=torch.zeros(1, 4))
    with pytest.raises(TypeError, match="stream"):
        t.gather([1], stream=object())
    t.close()


@pytest.mark.parametrize("ntables", [1, 3, 4, 5])
@pytest.mark.parametrize("dim", [3, 128, 129])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", ["cupy", "auto", "torch"])
def test_gather_scatter_many_bit_exact(backend, dtype, dim, ntables):
    """The fused several-tables path (and its per-table fallback) moves exactly the rows,
    into strided planes of a larger buffer, and leaves the other rows and planes alone."""
    from stpipe.host import gather_many, scatter_many

    need(backend)
    tabs = [HostTable(NUM_ROWS, dim, dtype, backend=backend) for _ in range(ntables)]
    try:
        refs = [random_bits(t, seed=10 * dim + g) for g, t in enumerate(tabs)]
        ids = np.sort(np.random.default_rng(dim).choice(NUM_ROWS, 77, replace=False))
        n = len(ids)
        buf = torch.full((ntables + 1, n + 9, dim), 7.0, dtype=dtype, device="cuda")
        planes = buf[:ntables, :n]
        gather_many(tabs, IndexBatch(host=ids, is_sorted=True), planes)
        torch.cuda.synchronize()
        for g in range(ntables):
            assert torch.equal(bits(planes[g]), bits(refs[g][ids]))
        assert (buf[:, n:] == 7).all() and (buf[ntables] == 7).all()
        new = torch.randn(ntables, n, dim, device="cuda").to(dtype)
        buf[:ntables, :n] = new
        scatter_many(tabs, ids, planes)
        for g, t in enumerate(tabs):
            want = refs[g].clone()
            want[ids] = new[g].cpu()
            assert torch.equal(bits(t.tensor()), bits(want))
        with pytest.raises(ValueError, match="expected a"):
            gather_many(tabs, ids, buf[:ntables, : n - 1])
    finally:
        for t in tabs:
            t.close()


@pytest.mark.parametrize("path", ["compiled", "torch"])
def test_upload_ring_is_asynchronous_and_exact(path, monkeypatch):
    """Packed uploads through the pinned ring arrive intact, in order, across wraps: packed
    and copied by stpipe._calls (nogil memcpy, cuMemcpyHtoDAsync) or by numpy + copy_."""
    from stpipe import _cuda, _staging

    if path == "torch":
        monkeypatch.setattr(_staging, "driver_calls", lambda: None)
    elif _cuda.driver_calls() is None:
        pytest.skip("stpipe._calls not built or libcuda.so.1 not loadable")

    s = torch.cuda.Stream()
    rng = np.random.default_rng(0)
    got, want = [], []
    for i in range(400):  # ~40 MB in total: the 8 MiB ring wraps several times
        arrs = [rng.integers(0, 1 << 40, rng.integers(0, 20000)), rng.random(rng.integers(1, 50)).astype(np.float32),
                np.array(i % 2 == 0)]
        got.append(_staging.upload(arrs, torch.device("cuda"), s))
        want.append(arrs)
    big = rng.integers(0, 9, 3 << 20)  # over half the ring: its own pinned buffer
    got.append(_staging.upload([big], torch.device("cuda"), s))
    want.append([big])
    s.synchronize()
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert a.device.type == "cuda" and a.shape == b.shape
            assert np.array_equal(a.cpu().numpy(), b)


@pytest.mark.parametrize("copy", ["driver", "refused"])
@pytest.mark.parametrize("where", ["current", "side"])
def test_upload_of_one_dtype_takes_the_packed_path(where, copy, monkeypatch):
    """Arrays of one dtype go through _upload_packed (one pack_htod, views by one
    unflatten call): exact values and shapes (2-d and 0-d included) across ring wraps, on
    the current stream or another one, with the event of ``event=True`` behind the copy;
    when the driver refuses the copy, torch copies the packed bytes instead. Mixed dtypes
    and empty arrays take the general path."""
    from stpipe import _cuda, _staging

    real = _cuda.driver_calls()
    if real is None:
        pytest.skip("stpipe._calls not built or libcuda.so.1 not loadable")
    if copy == "refused":
        class Refusing:  # packs, then reports the copy refused; the rest as the real calls
            def pack_htod(self, dst, arrays, offsets, dev, nbytes, stream):
                real.pack(dst, arrays, offsets)
                return 1

            def __getattr__(self, name):
                return getattr(real, name)

        monkeypatch.setattr(_staging, "driver_calls", lambda: Refusing())
    taken = []
    packed = _staging._upload_packed

    def counting(*a):
        out = packed(*a)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(_staging, "_upload_packed", counting)
    dev = torch.device("cuda", torch.cuda.current_device())
    s = torch.cuda.current_stream() if where == "current" else torch.cuda.Stream()
    rng = np.random.default_rng(1)
    got, want = [], []
    for i in range(300):  # ~30 MB: the 8 MiB ring wraps several times
        n = int(rng.integers(1, 20000))
        arrs = [rng.integers(-(1 << 40), 1 << 40, n), rng.integers(0, 9, (int(rng.integers(1, 9)), 3)),
                np.array(i, dtype=np.int64)]
        views, ev = _staging.upload(arrs, dev, s, event=True)
        got.append((views, ev))
        want.append(arrs)
    assert taken == [True] * 300
    mixed = _staging.upload([np.arange(5), np.ones(3, np.float32)], dev, s)
    empty = _staging.upload([np.arange(5), np.arange(0)], dev, s)
    assert taken[300:] == [False, False]
    for (views, ev), arrs in zip(got, want):
        ev.synchronize()
        for a, b in zip(views, arrs):
            assert a.device == dev and a.dtype == torch.int64 and tuple(a.shape) == b.shape
            assert np.array_equal(a.cpu().numpy(), b)
    s.synchronize()
    assert mixed[1].tolist() == [1.0, 1.0, 1.0] and empty[0].tolist() == [0, 1, 2, 3, 4] and empty[1].numel() == 0


@pytest.mark.parametrize("path", ["compiled", "ctypes", "cupy-launch"])
def test_cupy_backend_launch_paths(path, monkeypatch):
    """The CuPy backend launches through cuLaunchKernel (stpipe._calls, or its ctypes
    twin) when it can and through CuPy's own launch otherwise; all move exactly the rows,
    single and fused."""
    from stpipe.host import gather_many, scatter_many

    need("cupy")
    be = get_backend("cupy")
    if path == "cupy-launch":
        monkeypatch.setattr(be, "_driver", None)
    elif be._driver is None:
        pytest.skip("libcuda.so.1 not loadable by that name")
    elif path == "ctypes":
        monkeypatch.setattr(be._driver, "_calls", None)
    elif be._driver._calls is None:
        pytest.skip("stpipe._calls not built")
    calls = {"fast": 0, "compiled": 0}
    real_fast = type(be)._fast

    def counting(self, *a, **kw):
        ok = real_fast(self, *a, **kw)
        calls["fast"] += bool(ok)
        return ok

    monkeypatch.setattr(type(be), "_fast", counting)
    if path == "compiled":  # every launch ends in _calls.launch: count the accepted ones
        real_calls = be._driver._calls

        class Counting:
            def __getattr__(self, name):
                return getattr(real_calls, name)

            def launch(self, *args):
                err = real_calls.launch(*args)
                calls["compiled"] += err == 0
                return err

        monkeypatch.setattr(be._driver, "_calls", Counting())
    tabs = [HostTable(NUM_ROWS, 128, torch.float32, backend="cupy") for _ in range(5)]
    try:
        refs = [random_bits(t, seed=g) for g, t in enumerate(tabs)]
        ids = np.random.default_rng(5).choice(NUM_ROWS, 300, replace=False)
        got = tabs[0].gather(ids)
        torch.cuda.synchronize()
        assert torch.equal(bits(got), bits(refs[0][ids]))
        planes = torch.empty(5, 300, 128, device="cuda")
        gather_many(tabs, ids, planes)
        torch.cuda.synchronize()
        for g in range(5):
            assert torch.equal(bits(planes[g]), bits(refs[g][ids]))
        new = torch.randn(5, 300, 128, device="cuda")
        scatter_many(tabs, ids, new)
        for g, t in enumerate(tabs):
            want = refs[g].clone()
            want[ids] = new[g].cpu()
            assert torch.equal(bits(t.tensor()), bits(want))
    finally:
        for t in tabs:
            t.close()
    if path == "compiled":  # 1 single + 2 fused groups per direction (5 tables)
        assert calls["compiled"] >= 5
    elif path == "ctypes":
        assert calls["fast"] >= 5
    else:
        assert calls["fast"] == 0


def test_on_stream_switches_and_restores():
    from stpipe._streams import current_stream, on_stream

    dev = torch.device("cuda", torch.cuda.current_device())
    before = torch.cuda.current_stream(dev)
    assert current_stream(dev) == before
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    with on_stream(s1):
        assert torch.cuda.current_stream(dev) == s1
        assert current_stream(dev) == s1
        x = torch.ones(1000, device=dev)  # allocated and filled on s1
        with on_stream(s2):
            assert torch.cuda.current_stream(dev) == s2
        assert torch.cuda.current_stream(dev) == s1
    assert torch.cuda.current_stream(dev) == before
    assert current_stream(dev) == before
    s1.synchronize()
    assert float(x.sum()) == 1000.0
    with pytest.raises(KeyError):
        with on_stream(s1):
            raise KeyError("inside")
    assert torch.cuda.current_stream(dev) == before
    # the stream already current: nothing is set, and leaving keeps it (also nested)
    with on_stream(before):
        assert torch.cuda.current_stream(dev) == before
    assert torch.cuda.current_stream(dev) == before
    with on_stream(s1):
        with on_stream(s1):
            assert torch.cuda.current_stream(dev) == s1
        assert torch.cuda.current_stream(dev) == s1
    assert torch.cuda.current_stream(dev) == before


@pytest.mark.parametrize("dtype,dim,planes", [(torch.float32, 128, 3), (torch.float16, 3, 1),
                                              (torch.bfloat16, 64, 4), (torch.float32, 5, 2)])
def test_carry_many_bit_exact(dtype, dim, planes):
    """The pipeline's carry kernel: dst[g, to[j]] = src[g, from[j]] for the first planes,
    exact bits, other rows and the last plane untouched, buffers of two capacities."""
    need("cupy")
    be = get_backend("cupy")
    g = torch.Generator(device="cuda").manual_seed(0)
    src_buf = torch.randn(planes + 1, 700, dim, device="cuda", generator=g).to(dtype)
    dst_buf = torch.randn(planes + 1, 500, dim, device="cuda", generator=g).to(dtype)
    rng = np.random.default_rng(1)
    frm = torch.from_numpy(rng.choice(700, 333, replace=False)).cuda()
    to = torch.from_numpy(rng.choice(500, 333, replace=False)).cuda()
    want = dst_buf.clone()
    want[:planes, to] = src_buf[:planes, frm]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    be.carry_many(src_buf, dst_buf, planes, frm.data_ptr(), to.data_ptr(), 333, s)
    be.carry_many(src_buf, dst_buf, planes, frm.data_ptr(), to.data_ptr(), 0, s)  # no launch
    s.synchronize()
    assert torch.equal(bits(dst_buf), bits(want))


@pytest.mark.parametrize("dtype,dim", [(torch.float32, 128), (torch.float16, 17), (torch.float32, 9)],
                         ids=["16-byte-words", "2-byte-words", "4-byte-words"])
def test_scatter_last_bit_exact_and_checked(dtype, dim):
    """The compat layer's last-wins scatter into a device table: over several calls with
    many repeats each id holds its last occurrence's row, bit for bit; a call with an id
    out of range writes nothing and raises its flag to call << 32."""
    need("cupy")
    be = get_backend("cupy")
    g = torch.Generator(device="cuda").manual_seed(2)
    table = torch.randn(300, dim, device="cuda", generator=g).to(dtype)
    want = table.clone()
    stamps = torch.zeros(300, dtype=torch.int64, device="cuda")
    bad = torch.zeros(1, dtype=torch.int64, device="cuda")
    rng = np.random.default_rng(5)
    stream = torch.cuda.current_stream()
    for call in range(1, 5):
        ids = rng.integers(0, 40 if call % 2 else 300, 500)
        rows = torch.randn(500, dim, device="cuda", generator=g).to(dtype)
        be.scatter_last(table, torch.from_numpy(ids).cuda(), rows, stamps, bad, call, stream)
        last = {int(i): j for j, i in enumerate(ids)}
        for i, j in last.items():
            want[i] = rows[j]
        assert torch.equal(bits(table), bits(want)), call
        assert int(bad.item()) == 0
    ids = torch.tensor([3, 7, 300, 5], device="cuda")
    be.scatter_last(table, ids, torch.ones(4, dim, device="cuda").to(dtype), stamps, bad, 5, stream)
    assert int(bad.item()) == 5 << 32
    assert torch.equal(bits(table), bits(want))
    ids = torch.tensor([-1, 2], device="cuda")
    be.scatter_last(table, ids, torch.ones(2, dim, device="cuda").to(dtype), stamps, bad, 6, stream)
    assert int(bad.item()) == 6 << 32
    assert torch.equal(bits(table), bits(want))
    ids = torch.tensor([2, 2], device="cuda")  # a good call after bad ones writes again
    rows = torch.randn(2, dim, device="cuda", generator=g).to(dtype)
    be.scatter_last(table, ids, rows, stamps, bad, 7, stream)
    want[2] = rows[1]
    assert torch.equal(bits(table), bits(want))


@pytest.mark.parametrize("dtype,dim", [(torch.float32, 128), (torch.float16, 3), (torch.bfloat16, 10)])
def test_host_table_device_id_paths(dtype, dim):
    """A pinned table moved by ids already on the GPU (the compat layer's CuPy ids):
    ``_gather_device`` reads exactly ``table[ids]``; ``_scatter_last`` leaves each repeated
    id's *last* row, bit for bit, over several calls interleaved with gathers on another
    stream; both answer None/False without a UVA kernel (a torch-backend table)."""
    need("cupy")
    t = HostTable(400, dim, dtype, device="cuda", pin=True, backend="cupy")
    want = random_bits(t, 3).clone()
    rng = np.random.default_rng(6)
    side = torch.cuda.Stream()
    for call in range(4):
        ids = rng.integers(0, 30 if call % 2 else 400, 600)  # repeats; then mostly distinct
        rows = torch.randn(600, dim, device="cuda").to(dtype)
        assert t._scatter_last(torch.from_numpy(ids).cuda(), rows)
        rows_cpu = rows.cpu()
        for j, i in enumerate(ids):
            want[i] = rows_cpu[j]
        q = torch.from_numpy(rng.integers(0, 400, 250)).cuda()
        side.wait_stream(torch.cuda.current_stream())
        got = t._gather_device(q, stream=side)
        side.synchronize()
        assert torch.equal(bits(got.cpu()), bits(want[q.cpu()]))
        torch.cuda.synchronize()
        assert torch.equal(bits(t.tensor()), bits(want)), call
    assert t._scatter_last(torch.empty(0, dtype=torch.int64, device="cuda"),
                           torch.empty(0, dim, device="cuda").to(dtype))
    assert t._gather_device(torch.empty(0, dtype=torch.int64, device="cuda")).shape == (0, dim)
    plain = HostTable(50, dim, dtype, device="cuda", pin=True, backend="torch")
    ids = torch.tensor([1, 1], device="cuda")
    assert plain._gather_device(ids) is None
    assert not plain._scatter_last(ids, torch.zeros(2, dim, device="cuda").to(dtype))
    t.close()
    plain.close()


@pytest.mark.parametrize("ka,kb", [(3, 2), (1, 3), (2, 2)])
@pytest.mark.parametrize("na,nb", [(77, 300), (250, 5), (40, 0)])
@pytest.mark.parametrize("dtype,dim", [(torch.float32, 128), (torch.float16, 17), (torch.float32, 9)],
                         ids=["16-byte-words", "2-byte-words", "4-byte-words"])
def test_paired_moves_bit_exact(dtype, dim, na, nb, ka, kb):
    """Two groups of tables (each with its own ids, count and strided planes) gathered and
    scattered by one paired launch land exactly as two separate fused launches would, and
    nothing outside the named rows and planes moves."""
    from stpipe.host import _prepare_move, _prepare_pair, _finish

    need("cupy")
    n_rows = 400
    ta = [HostTable(n_rows, dim, dtype, backend="cupy") for _ in range(ka)]
    tb = [HostTable(n_rows, dim, dtype, backend="cupy") for _ in range(kb)]
    try:
        refs_a = [random_bits(t, seed=50 + g) for g, t in enumerate(ta)]
        refs_b = [random_bits(t, seed=90 + g) for g, t in enumerate(tb)]
        rng = np.random.default_rng(na + nb)
        ids_a = torch.from_numpy(np.sort(rng.choice(n_rows, na, replace=False))).cuda()
        ids_b = torch.from_numpy(rng.choice(n_rows, nb, replace=False)).cuda()
        buf_a = torch.full((ka + 1, 260, dim), 7.0, dtype=dtype, device="cuda")
        buf_b = torch.full((kb + 1, 310, dim), 5.0, dtype=dtype, device="cuda")
        ga, gb = _prepare_move("gather", ta, buf_a[:ka]), _prepare_move("gather", tb, buf_b[:kb])
        pair = _prepare_pair(ga, gb)
        assert pair is not None
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        pending: list = []
        pair(ids_a.data_ptr(), na, ids_b.data_ptr(), nb, s, pending)
        _finish(pending, s)
        s.synchronize()
        for g in range(ka):
            assert torch.equal(bits(buf_a[g, :na]), bits(refs_a[g][ids_a.cpu()]))
        for g in range(kb):
            assert torch.equal(bits(buf_b[g, :nb]), bits(refs_b[g][ids_b.cpu()]))
        assert (buf_a[:, na:] == 7).all() and (buf_a[ka] == 7).all()
        assert (buf_b[:, nb:] == 5).all() and (buf_b[kb] == 5).all()
        # scatter new rows back through the paired launch
        new_a = torch.randn(ka, na, dim, device="cuda").to(dtype)
        new_b = torch.randn(kb, nb, dim, device="cuda").to(dtype)
        buf_a[:ka, :na], buf_b[:kb, :nb] = new_a, new_b
        sa, sb = _prepare_move("scatter", ta, buf_a[:ka]), _prepare_move("scatter", tb, buf_b[:kb])
        spair = _prepare_pair(sa, sb)
        assert spair is not None
        s.wait_stream(torch.cuda.current_stream())
        pending = []
        spair(ids_a.data_ptr(), na, ids_b.data_ptr(), nb, s, pending)
        assert [p[1] for p in pending] == [sa.tables, sb.tables] and all(p[2] for p in pending)
        _finish(pending, s)
        for g, t in enumerate(ta):
            want = refs_a[g].clone()
            want[ids_a.cpu()] = new_a[g].cpu()
            assert torch.equal(bits(t.tensor()), bits(want))  # tensor() waits for the write event
        for g, t in enumerate(tb):
            want = refs_b[g].clone()
            want[ids_b.cpu()] = new_b[g].cpu()
            assert torch.equal(bits(t.tensor()), bits(want))
    finally:
        for t in ta + tb:
            t.close()


def test_pairs_that_cannot_share_a_launch_are_refused():
    """prepare_pair / prepare_carry_pair return None (the caller launches each) for other
    ops, other word sizes, more tables than a group holds, or an empty carry."""
    from stpipe.host import _prepare_move, _prepare_pair
    from stpipe.kernels._cupy import PAIR

    need("cupy")
    be = get_backend("cupy")
    t128 = [HostTable(50, 128, torch.float32, backend="cupy") for _ in range(PAIR + 1)]
    t9 = [HostTable(50, 9, torch.float32, backend="cupy")]
    try:
        b128 = torch.zeros(PAIR + 1, 20, 128, device="cuda")
        b9 = torch.zeros(1, 20, 9, device="cuda")
        g1 = _prepare_move("gather", t128[:1], b128[:1])
        assert _prepare_pair(g1, _prepare_move("scatter", t128[1:2], b128[1:2])) is None  # ops differ
        assert _prepare_pair(g1, _prepare_move("gather", t9, b9)) is None  # 16- vs 4-byte words
        assert _prepare_pair(g1, _prepare_move("gather", t128, b128)) is None  # PAIR + 1 tables
        assert _prepare_pair(g1, _prepare_move("gather", t128[1:PAIR + 1], b128[1:PAIR + 1])) is not None
        src = torch.zeros(3, 10, 128, device="cuda")
        assert be.prepare_carry_pair(be.prepare_carry(src, b128, 2), be.prepare_carry(src, b128, 0)) is None
        assert be.prepare_carry_pair(be.prepare_carry(src, b128, 2), be.prepare_carry(b9, b9, 1)) is None
        assert be.prepare_carry_pair(be.prepare_carry(src, b128, 2), be.prepare_carry(b128, src, 3)) is not None
    finally:
        for t in t128 + t9:
            t.close()


@pytest.mark.parametrize("dtype,dim,pa,pb", [(torch.float32, 128, 3, 3), (torch.float16, 3, 1, 2),
                                             (torch.float32, 5, 2, 1)])
@pytest.mark.parametrize("na,nb", [(333, 21), (4, 290), (0, 50)])
def test_carry_pair_bit_exact(dtype, dim, pa, pb, na, nb):
    """Two carries (each its own buffers, planes and index lists) in one launch land as two
    separate carry launches would: exact bits, other rows and planes untouched."""
    need("cupy")
    be = get_backend("cupy")
    g = torch.Generator(device="cuda").manual_seed(3)
    bufs = [torch.randn(p + 1, cap, dim, device="cuda", generator=g).to(dtype)
            for p, cap in ((pa, 700), (pa, 500), (pb, 300), (pb, 320))]
    rng = np.random.default_rng(na * 7 + nb)
    fa = torch.from_numpy(rng.choice(700, na, replace=False)).cuda()
    ta_ = torch.from_numpy(rng.choice(500, na, replace=False)).cuda()
    fb = torch.from_numpy(rng.choice(300, nb, replace=False)).cuda()
    tb_ = torch.from_numpy(rng.choice(320, nb, replace=False)).cuda()
    want_a, want_b = bufs[1].clone(), bufs[3].clone()
    want_a[:pa, ta_] = bufs[0][:pa, fa]
    want_b[:pb, tb_] = bufs[2][:pb, fb]
    pair = be.prepare_carry_pair(be.prepare_carry(bufs[0], bufs[1], pa), be.prepare_carry(bufs[2], bufs[3], pb))
    assert pair is not None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    pair(fa.data_ptr(), ta_.data_ptr(), na, fb.data_ptr(), tb_.data_ptr(), nb, s)
    s.synchronize()
    assert torch.equal(bits(bufs[1]), bits(want_a))
    assert torch.equal(bits(bufs[3]), bits(want_b))

"""CPU tests of stpipe.kernels: registry, lazy imports, launch arithmetic, torch chunking."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from stpipe import BackendUnavailableError, StpipeValueError
from stpipe.kernels import BACKENDS, IndexBatch, get_backend, row_bytes
from stpipe.kernels._cupy import KERNEL_SOURCE, launch_shape, word_bytes


def test_unknown_backend():
    with pytest.raises(StpipeValueError, match="backend must be one of"):
        get_backend("jax")
    with pytest.raises(ValueError):
        get_backend(None)


def test_torch_backend_is_cached_and_always_available():
    assert get_backend("torch") is get_backend("torch")
    assert get_backend("torch").uses_cpu and not get_backend("torch").needs_pinned


def _importable(name):
    code = f"import {name}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.skipif(_importable("cupy"), reason="CuPy is installed here")
def test_cupy_missing_raises_clear_error():
    with pytest.raises(BackendUnavailableError, match="cupy-cuda"):
        get_backend("cupy")


def test_numba_shim_runs_before_numba_cuda(monkeypatch):
    """np.row_stack is restored before numba.cuda loads (numpy 2.5 removed it)."""
    from stpipe.kernels import _numba

    had = hasattr(np, "row_stack")
    monkeypatch.delattr(np, "row_stack", raising=False)
    try:
        _numba.NumbaBackend()
    except BackendUnavailableError as exc:
        assert "numba" in str(exc) and "backend='torch'" in str(exc)
    assert np.row_stack is np.vstack
    if not had:
        del np.row_stack


def test_backend_modules_import_lazily():
    code = ("import sys, stpipe.kernels._cupy, stpipe.kernels._numba, stpipe.kernels._auto, "
            "stpipe.kernels._torch; bad = [m for m in ('cupy', 'numba') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "rb, ptrs, want",
    [(512, (4096, 512), 16), (516, (4096, 512), 4), (512, (4096, 520), 4),
     (6, (4096, 512), 2), (2, (4096, 2), 2), (16, (4096, 16), 16), (48, (4096, 8), 4)],
)
def test_word_bytes(rb, ptrs, want):
    assert word_bytes(rb, *ptrs) == want


def test_word_bytes_refuses_odd():
    with pytest.raises(RuntimeError):
        word_bytes(3, 4096)


def test_launch_shape():
    assert launch_shape(1, 132) == (1, 256)
    assert launch_shape(256 * 10 + 1, 132) == (11, 256)
    assert launch_shape(10**9, 132) == (132 * 32, 256)


def test_kernel_source_defines_every_word():
    for w in ("w2_t", "w4_t", "w16_t"):
        for op in ("gather", "scatter"):
            assert f"STPIPE_KERNELS({w})" in KERNEL_SOURCE and op in KERNEL_SOURCE


def _emulate(words_host, ids, words):
    """Pure-numpy run of the kernels' index arithmetic (flattened grid-stride loop)."""
    total = len(ids) * words
    out = np.empty(total, dtype=words_host.dtype)
    k = np.arange(total)
    row = k // words
    w = k - row * words
    out[k] = words_host[ids[row] * words + w]
    return out


@pytest.mark.parametrize("dim", [1, 3, 8, 17, 128, 129])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["f32", "f16", "bf16"])
def test_kernel_index_arithmetic(dim, dtype):
    table = torch.randn(50, dim).to(dtype)
    rb = row_bytes(table)
    w = word_bytes(rb, 4096, 4096)
    np_word = {2: np.uint16, 4: np.uint32, 16: np.dtype((np.void, 16))}[w]
    flat = table.view(torch.uint8).numpy().reshape(-1).view(np_word)
    ids = np.array([7, 0, 49, 7, 3])
    got = _emulate(flat, ids, rb // w).view(np.uint8).reshape(len(ids), rb)
    assert np.array_equal(got, table[torch.from_numpy(ids)].view(torch.uint8).numpy())


def test_index_batch_cpu_view_shares_memory():
    host = np.array([4, 1, 9], dtype=np.int64)
    b = IndexBatch(host=host)
    assert len(b) == 3 and b.cpu(1).tolist() == [1, 9]
    host[2] = 5
    assert b.cpu().tolist() == [4, 1, 5]


def test_torch_chunks_cover_batch_exactly():
    from stpipe.kernels._torch import TorchBackend

    be = TorchBackend(chunk_bytes=1000)
    for n, rb in [(1, 4), (250, 4), (251, 4), (7, 4000), (0, 8)]:
        chunks = be._chunks(n, rb)
        assert sum(b - a for a, b in chunks) == n
        assert all(c[1] == d[0] for c, d in zip(chunks, chunks[1:]))


def test_auto_without_pinning_only_tries_torch():
    auto = get_backend("auto")
    assert [b.name for b in auto.candidates(pinned=False)] == ["torch"]
    assert auto.candidates()[0].name == "torch"
    key = auto.size_class("gather", torch.zeros(1000, 4), IndexBatch(np.arange(10)),
                          torch.device("cuda", 0))
    assert key[0] == "gather" and key[-1] is False


def test_backends_tuple():
    assert BACKENDS == ("auto", "torch", "cupy", "numba")


def test_registry_of_page_locked_ranges(monkeypatch):
    from stpipe import _cuda

    monkeypatch.setattr(_cuda, "_registered", {4096: 8192, 8192: 16384})
    assert _cuda.is_registered(4096, 12288)  # spans two adjacent registrations
    assert _cuda.is_registered(5000, 100)
    assert not _cuda.is_registered(4000, 200)  # starts before
    assert not _cuda.is_registered(16000, 1000)  # runs past the end


def test_upload_on_cpu_shares_memory():
    """On a CPU device the upload ring hands back the arrays as tensors, without copies."""
    from stpipe import _staging

    a = np.arange(5, dtype=np.int64)
    (t,) = _staging.upload([a], torch.device("cpu"))
    assert t.dtype == torch.int64 and t.tolist() == [0, 1, 2, 3, 4]
    assert t.data_ptr() == a.ctypes.data


@pytest.mark.parametrize("packer", ["numpy", "compiled"])
def test_upload_ring_layout_round_trips(packer):
    """The ring's packing and typed views (device-independent byte logic, here on a CPU
    byte buffer): every dtype, shape and size comes back exact, at aligned offsets, from
    the numpy packer and from its compiled twin (:func:`stpipe._calls.pack`)."""
    from stpipe import _staging

    rng = np.random.default_rng(0)
    hosts = [
        np.arange(7, dtype=np.int64),
        rng.standard_normal((3, 5)).astype(np.float32),
        np.array(42, dtype=np.int64),                       # 0-d
        np.empty((0, 4), dtype=np.float16),                 # empty
        rng.integers(0, 2, 9).astype(bool),
        rng.integers(-5, 5, (2, 3, 2)).astype(np.int32),
        rng.standard_normal(11).astype(np.float16),
        np.arange(6, dtype=np.int64).reshape(2, 3),         # a second int64 array
    ]
    offsets, total = [], 0
    for h in hosts:
        offsets.append(total)
        total += -(-h.nbytes // _staging._ALIGN) * _staging._ALIGN
    buf = np.zeros(max(total, _staging._ALIGN) + 64, dtype=np.uint8)
    if packer == "numpy":
        _staging._pack(buf, 64, hosts, offsets)
    else:
        calls = pytest.importorskip("stpipe._calls")
        assert _staging._pack_compiled(calls, buf.ctypes.data + 64, hosts, offsets)
    assert not buf[:64].any()  # nothing written before the region
    views = _staging._views(torch.from_numpy(buf[64:]), hosts, offsets)
    for h, v in zip(hosts, views):
        assert tuple(v.shape) == h.shape
        assert v.dtype == torch.from_numpy(np.empty(0, h.dtype)).dtype
        np.testing.assert_array_equal(v.numpy(), h)


def test_compiled_calls_checks_and_unbound_driver():
    """stpipe._calls: pack copies exactly the bytes asked and refuses what it cannot copy
    (the packer then falls back to numpy); the driver calls report -1 when unbound."""
    calls = pytest.importorskip("stpipe._calls")
    from stpipe import _staging

    dst = np.zeros(32, dtype=np.uint8)
    assert calls.pack(dst.ctypes.data, [np.array([1, 2], dtype=np.int16), b"ab"], [4, 10]) == 6
    assert dst.tolist()[:12] == [0, 0, 0, 0, 1, 0, 2, 0, 0, 0, 97, 98]
    assert calls.pack(dst.ctypes.data, [], []) == 0
    with pytest.raises(ValueError, match="one offset per array"):
        calls.pack(dst.ctypes.data, [dst], [])
    with pytest.raises(ValueError, match="offsets must be >= 0"):
        calls.pack(dst.ctypes.data, [dst[:2]], [-1])
    strided = np.arange(8, dtype=np.int64)[::2]
    before = dst.copy()
    assert not _staging._pack_compiled(calls, dst.ctypes.data, [dst[:1], strided], [0, 8])
    assert np.array_equal(dst, before)  # nothing copied when one array is refused
    with pytest.raises(ValueError, match="at most 16"):
        calls.launch(0, 1, 1, 1, 0, list(range(17)))
    with pytest.raises(OverflowError):
        calls.launch(0, 1, 1, 1, 0, [-1])
    if not calls.bound():  # CPU machines: never bound (no libcuda)
        assert calls.launch(0, 1, 1, 1, 0, [1, 2]) == -1
        assert calls.htod(0, 0, 0, 0) == -1
        # pack_htod packs, then reports the copy it could not make
        dst[:] = 0
        assert calls.pack_htod(dst.ctypes.data, [np.array([3, 4], dtype=np.int16)], [2], 0, 4, 0) == -1
        assert dst.tolist()[:6] == [0, 0, 3, 0, 4, 0]
        assert calls.pack_htod(dst.ctypes.data, [], [], 0, 0, 0) == -1
    before = dst.copy()
    with pytest.raises(ValueError):
        calls.pack_htod(dst.ctypes.data, [dst[:1], strided], [0, 8], 0, 16, 0)
    assert np.array_equal(dst, before)


def test_gather_many_on_cpu_matches_index_select():
    from stpipe.host import HostTable, gather_many, scatter_many

    tabs = [HostTable(50, 4, device="cpu").uniform_(-1, 1) for _ in range(3)]
    ids = np.array([1, 7, 30])
    out = torch.zeros(3, 5, 4)[:, :3]
    gather_many(tabs, ids, out)
    for g, t in enumerate(tabs):
        assert torch.equal(out[g], t.tensor()[ids])
    scatter_many(tabs, ids, torch.ones(3, 3, 4))
    for t in tabs:
        assert (t.tensor()[ids] == 1).all() and (t.tensor()[0] != 1).any()
    with pytest.raises(ValueError, match="expected a"):
        gather_many(tabs, ids, torch.zeros(2, 3, 4))


def test_prepared_move_orders_after_other_streams_then_launches():
    """host._PreparedMove (the pipeline's per-slot fused move), with a fake mover and
    stream: each table's conflicting event on another stream is waited on before the one
    launch, the bookkeeping goes to ``pending``, a closed table raises before anything."""
    from stpipe import StpipeRuntimeError
    from stpipe.host import HostTable, _PreparedMove

    log = []

    class Mover:
        needs_pinned, uses_cpu = True, False

        def prepare_many(self, op, datas, planes):
            log.append(("prepare", op, len(datas), tuple(planes.shape)))
            return lambda ptr, n, stream: log.append(("launch", ptr, n))

    class Stream:
        cuda_stream = 7

        def wait_event(self, ev):
            log.append(("wait", ev))

    class Ev:
        def __init__(self, name):
            self.name = name

        def synchronize(self):
            pass

        def __repr__(self):
            return self.name

    other, same = Ev("ev-other"), Ev("ev-same")
    tabs = [HostTable(20, 4) for _ in range(3)]
    try:
        planes = torch.zeros(3, 10, 4)
        mover = Mover()
        move = _PreparedMove("scatter", tabs, planes, mover)
        assert log == [("prepare", "scatter", 3, (3, 10, 4))] and move.write
        tabs[1]._write_event = (other, 99)  # written on another stream: waited on
        tabs[2]._read_events = {7: same}    # read on this stream: ordered already
        pending = []
        move(4096, 6, Stream(), pending)
        assert log[1:] == [("wait", other), ("launch", 4096, 6)]
        assert pending == [(mover, tabs, True)]
        tabs[0].close()
        with pytest.raises(StpipeRuntimeError):
            move(4096, 6, Stream(), [])
        assert log[-1] == ("launch", 4096, 6) and len(log) == 3
    finally:
        for t in tabs:
            t.close()

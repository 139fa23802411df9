"""The ``cupy`` backend: UVA gather/scatter kernels compiled with ``cupy.RawModule``.

The kernels read (gather) or write (scatter) page-locked host memory directly over PCIe
through its unified-virtual-address pointer. Rows are copied as raw machine words, so the
kernels are dtype-agnostic and bit-exact (float32, float16, bfloat16 alike). The word is
the widest of 16 bytes (``uint4``), 4 bytes or 2 bytes that divides the row size and the
alignment of every pointer: ``dim * itemsize % 16 == 0`` with 16-byte aligned buffers
gives vectorised 16-byte accesses, any other row size uses 4- or 2-byte words (a row is
then copied entirely in those words, so there is no tail case).

Thread mapping: one thread per word over the flattened ``(n, words_per_row)`` output,
grid-stride. Consecutive lanes touch consecutive words of a row (coalesced), and for a
512-byte row (128 float32) one warp moves one row with 16-byte accesses: the
warp-per-row kernel of DESIGN.md, without idle lanes for narrow rows.

The ``*_many`` kernels move up to four tables that share ids (a table and its optimizer
state) in one launch, ``blockIdx.y`` picking the table; the ``*_pair`` kernels move two
such groups of up to three tables, each group with its own ids and count, in one launch
(:meth:`CupyBackend.prepare_pair`, :meth:`CupyBackend.prepare_carry_pair`): the
pipeline's two tables of a step, e.g. skip-gram's input and output embeddings with Adam's
two state tables each, are gathered, written back and carried with one launch each
instead of two. A launch costs the training thread several microseconds of CPU, and the
step is CPU-bound.

CuPy is imported on first use of the backend; kernels compile lazily (NVRTC) and are
cached per device (CuPy additionally caches the binary on disk).
"""
from __future__ import annotations

import threading
import warnings
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from .._errors import BackendUnavailableError, StpipeRuntimeError
from . import IndexBatch, row_bytes

__all__ = ["CupyBackend", "KERNEL_SOURCE", "word_bytes", "launch_shape"]

KERNEL_SOURCE = r"""
typedef unsigned short w2_t;
typedef unsigned int w4_t;
typedef uint4 w16_t;

template <typename W>
__device__ __forceinline__ void gather_words(const W* __restrict__ table,
                                             const long long* __restrict__ ids,
                                             W* __restrict__ out,
                                             long long total, long long words) {
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (; k < total; k += stride) {
        const long long row = k / words;
        const long long w = k - row * words;
        out[k] = table[ids[row] * words + w];
    }
}

// dst[to[j]] = src[from[j]] row by row (device to device, two index lists): the
// pipeline's carry of rows a later batch shares with the step that just ran.
template <typename W>
__device__ __forceinline__ void carry_words(const W* __restrict__ src, W* __restrict__ dst,
                                            const long long* __restrict__ from,
                                            const long long* __restrict__ to,
                                            long long total, long long words) {
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (; k < total; k += stride) {
        const long long row = k / words;
        const long long w = k - row * words;
        dst[to[row] * words + w] = src[from[row] * words + w];
    }
}

template <typename W>
__device__ __forceinline__ void scatter_words(W* __restrict__ table,
                                              const long long* __restrict__ ids,
                                              const W* __restrict__ rows,
                                              long long total, long long words) {
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (; k < total; k += stride) {
        const long long row = k / words;
        const long long w = k - row * words;
        table[ids[row] * words + w] = rows[k];
    }
}

// Several tables that share ids (a table and its optimizer-state tables) in one launch:
// blockIdx.y picks the table (up to 4) and the matching plane of a (G, n, dim) buffer
// whose planes are out_stride words apart.
template <typename W>
__device__ __forceinline__ const W* pick(const W* t0, const W* t1, const W* t2, const W* t3) {
    const unsigned int g = blockIdx.y;
    return g == 0 ? t0 : (g == 1 ? t1 : (g == 2 ? t2 : t3));
}

// Two tables' moves in one launch (a step's tables, e.g. skip-gram's input and output
// embeddings, each with up to two state tables that share its ids): blockIdx.y below
// count_a is plane y of group a, the rest plane y - count_a of group b. Each group has
// its own ids, count and plane stride; the grid is sized for the larger group.
template <typename W>
__device__ __forceinline__ const W* pick3(const W* t0, const W* t1, const W* t2, unsigned int g) {
    return g == 0 ? t0 : (g == 1 ? t1 : t2);
}

// Last occurrence wins (the compat layer's GPU-resident insertData): pass 1 stamps each
// named row with the largest base + j naming it (base: a call number << 32, so stamps of
// earlier calls are smaller and the scratch is never cleared); an id outside [0, rows)
// stores base in *bad and stamps nothing. Pass 2 lets only each id's winning occurrence
// write its row, and writes nothing at all when pass 1 saw a bad id in this call.
__device__ __forceinline__ void stamp_last(const long long* __restrict__ ids,
                                           unsigned long long* __restrict__ stamps,
                                           unsigned long long* __restrict__ bad,
                                           long long n, long long rows, long long base) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (; j < n; j += stride) {
        const long long id = ids[j];
        if (id < 0 || id >= rows) {
            *bad = (unsigned long long)base;
            continue;
        }
        atomicMax(stamps + id, (unsigned long long)(base + j));
    }
}

template <typename W>
__device__ __forceinline__ void scatter_last_words(W* __restrict__ table,
                                                   const long long* __restrict__ ids,
                                                   const W* __restrict__ rows,
                                                   const unsigned long long* __restrict__ stamps,
                                                   const unsigned long long* __restrict__ bad,
                                                   long long base, long long total,
                                                   long long words) {
    if (*bad == (unsigned long long)base) return;
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (; k < total; k += stride) {
        const long long row = k / words;
        const long long w = k - row * words;
        const long long id = ids[row];
        if (stamps[id] == (unsigned long long)(base + row)) table[id * words + w] = rows[k];
    }
}

#define STPIPE_KERNELS(W)                                                              \
extern "C" __global__ void stpipe_gather_##W(const W* table, const long long* ids,     \
                                             W* out, long long total, long long words) \
{ gather_words<W>(table, ids, out, total, words); }                                    \
extern "C" __global__ void stpipe_scatter_##W(W* table, const long long* ids,          \
                                              const W* rows, long long total,          \
                                              long long words)                         \
{ scatter_words<W>(table, ids, rows, total, words); }                                  \
extern "C" __global__ void stpipe_gather_many_##W(const W* t0, const W* t1, const W* t2, \
        const W* t3, const long long* ids, W* out, long long plane, long long total,    \
        long long words)                                                               \
{ gather_words<W>(pick<W>(t0, t1, t2, t3), ids, out + blockIdx.y * plane, total, words); } \
extern "C" __global__ void stpipe_scatter_many_##W(W* t0, W* t1, W* t2, W* t3,          \
        const long long* ids, const W* rows, long long plane, long long total,         \
        long long words)                                                               \
{ scatter_words<W>(const_cast<W*>(pick<W>(t0, t1, t2, t3)), ids, rows + blockIdx.y * plane, \
                   total, words); }                                                    \
extern "C" __global__ void stpipe_carry_many_##W(const W* src, W* dst,                  \
        const long long* from, const long long* to, long long src_plane,               \
        long long dst_plane, long long total, long long words)                         \
{ carry_words<W>(src + blockIdx.y * src_plane, dst + blockIdx.y * dst_plane, from, to,  \
                 total, words); }                                                      \
extern "C" __global__ void stpipe_gather_pair_##W(const W* a0, const W* a1, const W* a2, \
        const W* b0, const W* b1, const W* b2, const long long* ids_a,                 \
        const long long* ids_b, W* out_a, W* out_b, long long plane_a, long long plane_b, \
        long long total_a, long long total_b, long long count_a, long long words)      \
{ const unsigned int y = blockIdx.y;                                                   \
  if (y < count_a) gather_words<W>(pick3<W>(a0, a1, a2, y), ids_a, out_a + y * plane_a, \
                                   total_a, words);                                    \
  else gather_words<W>(pick3<W>(b0, b1, b2, y - count_a), ids_b,                       \
                       out_b + (y - count_a) * plane_b, total_b, words); }             \
extern "C" __global__ void stpipe_scatter_pair_##W(W* a0, W* a1, W* a2, W* b0, W* b1,   \
        W* b2, const long long* ids_a, const long long* ids_b, const W* rows_a,        \
        const W* rows_b, long long plane_a, long long plane_b, long long total_a,      \
        long long total_b, long long count_a, long long words)                         \
{ const unsigned int y = blockIdx.y;                                                   \
  if (y < count_a) scatter_words<W>(const_cast<W*>(pick3<W>(a0, a1, a2, y)), ids_a,    \
                                    rows_a + y * plane_a, total_a, words);             \
  else scatter_words<W>(const_cast<W*>(pick3<W>(b0, b1, b2, y - count_a)), ids_b,      \
                        rows_b + (y - count_a) * plane_b, total_b, words); }           \
extern "C" __global__ void stpipe_carry_pair_##W(const W* src_a, W* dst_a,             \
        const long long* from_a, const long long* to_a, long long sp_a, long long dp_a, \
        long long total_a, const W* src_b, W* dst_b, const long long* from_b,          \
        const long long* to_b, long long sp_b, long long dp_b, long long total_b,      \
        long long planes_a, long long words)                                           \
{ const unsigned int y = blockIdx.y;                                                   \
  if (y < planes_a) carry_words<W>(src_a + y * sp_a, dst_a + y * dp_a, from_a, to_a,   \
                                   total_a, words);                                    \
  else carry_words<W>(src_b + (y - planes_a) * sp_b, dst_b + (y - planes_a) * dp_b,    \
                      from_b, to_b, total_b, words); }                                 \
extern "C" __global__ void stpipe_stamp_last_##W(const long long* ids,                  \
        unsigned long long* stamps, unsigned long long* bad, long long n, long long rows, \
        long long base)                                                                \
{ stamp_last(ids, stamps, bad, n, rows, base); }                                       \
extern "C" __global__ void stpipe_scatter_last_##W(W* table, const long long* ids,      \
        const W* rows, const unsigned long long* stamps, const unsigned long long* bad, \
        long long base, long long total, long long words)                              \
{ scatter_last_words<W>(table, ids, rows, stamps, bad, base, total, words); }

STPIPE_KERNELS(w2_t)
STPIPE_KERNELS(w4_t)
STPIPE_KERNELS(w16_t)
"""

_WORD_NAMES = {2: "w2_t", 4: "w4_t", 16: "w16_t"}
THREADS = 256
#: Tables per launch of the ``*_many`` kernels.
MANY = 4
#: Tables per group of the ``*_pair`` kernels (two groups per launch).
PAIR = 3


def word_bytes(rb: int, *ptrs: int) -> int:
    """The widest word (16, 4 or 2 bytes) dividing the row size ``rb`` and every pointer.

    Raises:
        StpipeRuntimeError: a row size or pointer that is not even 2-byte aligned.
    """
    for w in (16, 4, 2):
        if rb % w == 0 and all(p % w == 0 for p in ptrs):
            return w
    raise StpipeRuntimeError(f"rows of {rb} bytes or pointers {ptrs} are not 2-byte aligned")


#: the grid cap of the row kernels, in blocks per multiprocessor (they grid-stride, so
#: any cap is correct; a module constant so that benchmarks can try others)
BLOCKS_PER_SM = 32


def launch_shape(total: int, sm_count: int) -> Tuple[int, int]:
    """``(blocks, threads)`` for ``total`` words: enough blocks to keep many PCIe reads in
    flight, capped at :data:`BLOCKS_PER_SM` per multiprocessor (the kernels grid-stride)."""
    blocks = min(-(-total // THREADS), max(1, sm_count) * BLOCKS_PER_SM)
    return max(1, blocks), THREADS


class _DriverLaunch:
    """``cuLaunchKernel`` through ctypes, for kernels whose parameters are all 8 bytes.

    Why: CuPy's generic launch from Python (argument boxing, a device context switch,
    stream lookup) cost about 40 us per call in the pipeline's cProfile on the H200 host,
    four calls per training step. This path costs a few microseconds. The library is
    opened with ``ctypes.PyDLL``, so the call keeps the GIL (a launch is too short to be
    worth handing the GIL to another thread, which costs more than the launch).
    """

    def __init__(self) -> None:
        import ctypes

        from .._cuda import driver_calls

        lib = ctypes.PyDLL("libcuda.so.1")
        fn = lib.cuLaunchKernel
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        self._fn = fn
        self._ct = ctypes
        #: the compiled call (:func:`stpipe._calls.launch`: no ctypes objects per
        #: launch), where the extension is built; the ctypes path is its twin
        self._calls = driver_calls()

    def __call__(self, func: int, grid: Tuple[int, int], block: int, stream: int,
                 values: Sequence[int]) -> int:
        """Launch ``func`` on ``stream`` (a raw handle); returns the CUresult (0: ok)."""
        calls = self._calls
        if calls is not None:
            return calls.launch(func, grid[0], grid[1], block, stream, values)
        ct = self._ct
        n = len(values)
        vals = (ct.c_uint64 * n)(*values)
        base = ct.addressof(vals)
        params = (ct.c_void_p * n)(*range(base, base + 8 * n, 8))
        return self._fn(func, grid[0], grid[1], 1, block, 1, 1, 0, stream, params, None)


#: the calling thread's current CUDA device (``torch.cuda.current_device()`` without its
#: Python layer; used only once CUDA is initialised, as prepared moves are made after)
_get_device = getattr(torch._C, "_cuda_getDevice", None) or (lambda: torch.cuda.current_device())

#: CUDA_ERROR_INVALID_CONTEXT: the calling thread has no current context yet
_NO_CONTEXT = 201
_UNKNOWN = object()


class _Prepared:
    """One fused move (:meth:`CupyBackend.prepare_many`): ``prepared(ids_ptr, n, stream)``
    launches it for the ``n`` int64 ids at device address ``ids_ptr`` on ``stream``."""

    __slots__ = ("_backend", "_index", "_name", "_word", "_words", "_sms", "_plane", "_groups")

    def __init__(self, backend: "CupyBackend", index: int, name: str, word: int, words: int,
                 sms: int, plane: int, groups: Sequence[Tuple[Tuple[int, ...], int, int]]) -> None:
        self._backend, self._index, self._name, self._word = backend, index, name, word
        self._words, self._sms, self._plane, self._groups = words, sms, plane, list(groups)

    def __call__(self, ids_ptr: int, n: int, stream: "torch.cuda.Stream") -> None:
        if n <= 0:
            return
        words = self._words
        total = n * words
        blocks, threads = launch_shape(total, self._sms)
        be, index, name, word = self._backend, self._index, self._name, self._word
        for part, base, count in self._groups:
            be._run(index, name, word, (blocks, count), threads, stream,
                    (*part, ids_ptr, base, self._plane, total, words), MANY + 2)


class _PreparedCarry:
    """One :meth:`CupyBackend.carry_many` between fixed buffers
    (:meth:`CupyBackend.prepare_carry`)."""

    __slots__ = ("_backend", "_index", "_word", "_words", "_sms", "_src", "_dst", "_sp", "_dp", "_planes")

    def __init__(self, backend: "CupyBackend", index: int, word: int, words: int, sms: int,
                 src: int, dst: int, sp: int, dp: int, planes: int) -> None:
        self._backend, self._index, self._word, self._words, self._sms = backend, index, word, words, sms
        self._src, self._dst, self._sp, self._dp, self._planes = src, dst, sp, dp, planes

    def __call__(self, src_rows: int, dst_rows: int, n: int, stream: "torch.cuda.Stream") -> None:
        if n <= 0 or self._planes <= 0:
            return
        words = self._words
        total = n * words
        blocks, threads = launch_shape(total, self._sms)
        values = (self._src, self._dst, src_rows, dst_rows, self._sp, self._dp, total, words)
        self._backend._run(self._index, "carry_many", self._word, (blocks, self._planes), threads,
                           stream, values, 4)


class _PreparedPair:
    """Two prepared fused moves of one op in one launch (:meth:`CupyBackend.prepare_pair`):
    ``pair(ids_a, n_a, ids_b, n_b, stream)``, each group with its own ids."""

    __slots__ = ("_backend", "_index", "_name", "_word", "_words", "_sms", "_a", "_b", "_count")

    def __init__(self, backend: "CupyBackend", a: _Prepared, b: _Prepared) -> None:
        self._backend, self._index, self._word, self._words = backend, a._index, a._word, a._words
        self._name = a._name[: -len("_many")] + "_pair"
        self._sms = backend._sms_of(a._index, self._name, a._word)
        (pa, base_a, ca), (pb, base_b, cb) = a._groups[0], b._groups[0]
        self._a = (tuple(pa[:PAIR]), base_a, a._plane)
        self._b = (tuple(pb[:PAIR]), base_b, b._plane)
        self._count = (ca, cb)

    def __call__(self, ids_a: int, n_a: int, ids_b: int, n_b: int, stream: "torch.cuda.Stream") -> None:
        words = self._words
        total_a, total_b = max(0, n_a) * words, max(0, n_b) * words
        if total_a == 0 and total_b == 0:
            return
        blocks, threads = launch_shape(max(total_a, total_b), self._sms)
        (ta, base_a, plane_a), (tb, base_b, plane_b) = self._a, self._b
        ca, cb = self._count
        self._backend._run(self._index, self._name, self._word, (blocks, ca + cb), threads, stream,
                           (*ta, *tb, ids_a, ids_b, base_a, base_b, plane_a, plane_b, total_a, total_b,
                            ca, words), 2 * PAIR + 4)


class _PreparedCarryPair:
    """Two prepared carries in one launch (:meth:`CupyBackend.prepare_carry_pair`):
    ``pair(from_a, to_a, n_a, from_b, to_b, n_b, stream)``."""

    __slots__ = ("_backend", "_index", "_word", "_words", "_sms", "_a", "_b")

    def __init__(self, backend: "CupyBackend", a: _PreparedCarry, b: _PreparedCarry) -> None:
        self._backend, self._index, self._word, self._words = backend, a._index, a._word, a._words
        self._sms = backend._sms_of(a._index, "carry_pair", a._word)
        self._a = (a._src, a._dst, a._sp, a._dp, a._planes)
        self._b = (b._src, b._dst, b._sp, b._dp, b._planes)

    def __call__(self, from_a: int, to_a: int, n_a: int, from_b: int, to_b: int, n_b: int,
                 stream: "torch.cuda.Stream") -> None:
        words = self._words
        total_a, total_b = max(0, n_a) * words, max(0, n_b) * words
        if total_a == 0 and total_b == 0:
            return
        blocks, threads = launch_shape(max(total_a, total_b), self._sms)
        sa, da, spa, dpa, pa = self._a
        sb, db, spb, dpb, pb = self._b
        self._backend._run(self._index, "carry_pair", self._word, (blocks, pa + pb), threads, stream,
                           (sa, da, from_a, to_a, spa, dpa, total_a, sb, db, from_b, to_b, spb, dpb,
                            total_b, pa, words), 4)


def _device_pointer_check(cp, ptr: int) -> None:
    """Check that the host pointer is page-locked and directly usable on the device."""
    try:
        attrs = cp.cuda.runtime.pointerGetAttributes(ptr)
        kind, dptr = int(attrs.type), int(attrs.devicePointer)
    except Exception as exc:
        raise StpipeRuntimeError(
            f"cannot query the host table at {ptr:#x} ({exc}); create the table with pin=True"
        ) from None
    if kind != 1:  # cudaMemoryTypeHost: page-locked host memory known to CUDA
        raise StpipeRuntimeError(
            f"host table at {ptr:#x} is not page-locked (CUDA memory type {kind}); "
            "create the table with pin=True"
        )
    if dptr != ptr:
        raise BackendUnavailableError(
            "this system maps page-locked host memory at a different device address "
            "(no unified addressing); use backend='torch'"
        )


class CupyBackend:
    """UVA kernels through CuPy (see the module docstring).

    Raises:
        BackendUnavailableError: CuPy is missing or cannot initialise CUDA.
    """

    name = "cupy"
    uses_cpu = False
    needs_pinned = True

    def __init__(self) -> None:
        try:
            import cupy as cp

            cp.cuda.runtime.getDeviceCount()
        except Exception as exc:
            raise BackendUnavailableError(
                f"the cupy backend needs CuPy with a working CUDA ({type(exc).__name__}: "
                f"{exc}); install cupy-cuda12x or cupy-cuda13x to match your CUDA, or use "
                "backend='torch'"
            ) from None
        self._cp = cp
        self._lock = threading.Lock()
        self._modules: Dict[int, object] = {}
        self._kernels: Dict[Tuple[int, str, int], object] = {}
        self._sms: Dict[int, int] = {}
        self._checked: Dict[Tuple[int, int], bool] = {}
        self._streams: Dict[Tuple[int, int], object] = {}
        #: (device, kernel, word) -> CuPy Function (its ``ptr`` is the CUfunction), or
        #: None where this CuPy does not expose it
        self._functions: Dict[Tuple[int, str, int], object] = {}
        self._driver: Optional[_DriverLaunch] = None
        try:
            self._driver = _DriverLaunch()
        except (OSError, AttributeError):  # no libcuda.so.1 by that name: CuPy launches
            self._driver = None

    def _kernel(self, device: int, op: str, word: int):
        key = (device, op, word)
        k = self._kernels.get(key)
        if k is not None:
            return k
        cp = self._cp
        with self._lock, cp.cuda.Device(device):
            mod = self._modules.get(device)
            if mod is None:
                mod = cp.RawModule(code=KERNEL_SOURCE, options=("--std=c++14",))
                self._modules[device] = mod
            k = mod.get_function(f"stpipe_{op}_{_WORD_NAMES[word]}")
            self._sms[device] = cp.cuda.Device(device).attributes["MultiProcessorCount"]
            self._kernels[key] = k
        return k

    def _stream(self, index: int, stream: "torch.cuda.Stream"):
        """A CuPy view of the torch stream (cached per handle: made once, no copy)."""
        key = (index, int(stream.cuda_stream))
        got = self._streams.get(key)
        if got is None:
            cp = self._cp
            got = cp.cuda.ExternalStream(key[1], index)
            self._streams[key] = got
        return got

    def _check_pinned(self, index: int, ptr: int) -> None:
        """:func:`_device_pointer_check` once per table pointer (``data_ptr()``) and device."""
        base = (index, ptr)
        if base not in self._checked:
            with self._cp.cuda.Device(index):
                _device_pointer_check(self._cp, ptr)
            self._checked[base] = True

    def _launch(self, op: str, table: torch.Tensor, ids: IndexBatch, dev_buf: torch.Tensor,
                stream: "torch.cuda.Stream") -> None:
        n = len(ids)
        if n == 0:
            return
        device = dev_buf.device
        index = device.index
        rb = row_bytes(table)
        tptr, bptr = table.data_ptr(), dev_buf.data_ptr()
        self._check_pinned(index, tptr)
        word = word_bytes(rb, tptr, bptr)
        words = rb // word
        total = n * words
        blocks, threads = launch_shape(total, self._sms_of(index, op, word))
        id_t = ids.on_device(device, stream)
        self._run(index, op, word, (blocks, 1), threads, stream,
                  (tptr, id_t.data_ptr(), bptr, total, words), pointers=3)

    def _sms_of(self, index: int, name: str, word: int) -> int:
        """The device's multiprocessor count (known once a kernel is compiled there)."""
        self._kernel(index, name, word)
        return self._sms[index]

    def _run(self, index: int, name: str, word: int, grid: Tuple[int, int], block: int,
             stream: "torch.cuda.Stream", values: Sequence[int], pointers: int) -> None:
        """Launch kernel ``name`` with ``values`` (the first ``pointers`` of them are
        pointers, the rest 64-bit integers; all non-negative).

        Three ways, the cheapest that applies: the compiled driver call
        (:func:`stpipe._calls.launch`) straight away once the kernel's CUfunction is known
        and its device is current in this thread (the prepared moves' every launch after
        the first); :meth:`_fast` (looks the function up, handles the driver's errors; a
        launch the compiled call refused is made again there); CuPy's own launch.
        """
        drv = self._driver
        calls = drv._calls if drv is not None else None
        if calls is not None:
            fn = self._functions.get((index, name, word))
            if fn is not None and _get_device() == index and \
                    calls.launch(fn.ptr, grid[0], grid[1], block, stream.cuda_stream, values) == 0:
                return
        if self._fast(index, name, word, grid, block, stream, values):
            return
        args = tuple(np.uint64(v) for v in values[:pointers]) + tuple(np.int64(v) for v in values[pointers:])
        with self._cp.cuda.Device(index):
            self._kernel(index, name, word)(grid, (block,), args, stream=self._stream(index, stream))

    def _fast(self, index: int, name: str, word: int, grid: Tuple[int, int], block: int,
              stream: "torch.cuda.Stream", values: Sequence[int]) -> bool:
        """Launch kernel ``name`` through :class:`_DriverLaunch` when it can; False asks
        the caller to launch through CuPy (no driver library, no function handle, another
        device current in this thread, or no context current in it yet)."""
        drv = self._driver
        if drv is None:
            return False
        key = (index, name, word)
        fn = self._functions.get(key, _UNKNOWN)
        if fn is _UNKNOWN:
            try:  # the CUfunction handle lives with its module; the object keeps both
                with self._cp.cuda.Device(index):
                    fn = self._kernel(index, name, word).kernel
                int(fn.ptr)
            except Exception:  # a CuPy without RawKernel.kernel.ptr
                fn = None
            self._functions[key] = fn
        if fn is None or torch.cuda.current_device() != index:
            return False
        err = drv(fn.ptr, grid, block, int(stream.cuda_stream), values)
        if err == 0:
            return True
        if err != _NO_CONTEXT:
            # a launch the driver refused (not a fault of a running kernel): CuPy's own
            # launch from now on, which raises with CUDA's message if it fails too
            self._driver = None
            warnings.warn(f"stpipe: cuLaunchKernel({name}) returned CUDA error {err}; "
                          "launching through CuPy from now on", RuntimeWarning, stacklevel=4)
        return False

    def prepare_many(self, op: str, tables: Sequence[torch.Tensor], planes: torch.Tensor) -> "_Prepared":
        """``op`` ("gather"/"scatter") of up to :data:`MANY` tables per launch over the
        planes of ``planes``, with everything but the ids and their count worked out once.

        ``planes`` fixes the device buffer: plane ``g`` starts at
        ``planes.data_ptr() + g * planes.stride(0) * itemsize`` and its rows are
        contiguous; calls may move any ``n`` rows up to the buffer's capacity. The pinned
        check of each table runs here, once. The pipeline keeps one per staging slot and
        table group, so a batch's gather or write-back is one call per table group, and
        two groups (a step's two tables) share one launch through :meth:`prepare_pair`.
        """
        device = planes.device
        index = device.index
        rb = row_bytes(tables[0])
        ptrs = [t.data_ptr() for t in tables]
        for p in ptrs:
            self._check_pinned(index, p)
        plane_bytes = planes.stride(0) * planes.element_size()
        word = word_bytes(rb, planes.data_ptr(), plane_bytes, *ptrs)
        name = op + "_many"
        groups = []
        for g in range(0, len(tables), MANY):
            part = ptrs[g:g + MANY]
            groups.append((tuple(part + [part[0]] * (MANY - len(part))),
                           planes.data_ptr() + g * plane_bytes, min(MANY, len(tables) - g)))
        return _Prepared(self, index, name, word, rb // word, self._sms_of(index, name, word),
                         plane_bytes // word, groups)

    def prepare_pair(self, a: "_Prepared", b: "_Prepared") -> Optional["_PreparedPair"]:
        """Two prepared moves of one op (:meth:`prepare_many`, e.g. two tables of a
        pipeline step, each with its state tables) as one launch:
        ``pair(ids_a, n_a, ids_b, n_b, stream)`` does what ``a(ids_a, n_a, stream)`` and
        ``b(ids_b, n_b, stream)`` do. ``None`` where they cannot share a launch: another
        device, op or word size, or more than :data:`PAIR` tables in either.
        Stream: as the two calls, both on ``stream``."""
        if not (isinstance(a, _Prepared) and isinstance(b, _Prepared)) or a._backend is not self \
                or b._backend is not self:
            return None
        if (a._index, a._name, a._word, a._words) != (b._index, b._name, b._word, b._words):
            return None
        if len(a._groups) != 1 or len(b._groups) != 1 or a._groups[0][2] > PAIR or b._groups[0][2] > PAIR:
            return None
        return _PreparedPair(self, a, b)

    def prepare_carry_pair(self, a: "_PreparedCarry", b: "_PreparedCarry") -> Optional["_PreparedCarryPair"]:
        """Two prepared carries (:meth:`prepare_carry`, e.g. two tables' fix-ups of one
        step) as one launch: ``pair(from_a, to_a, n_a, from_b, to_b, n_b, stream)`` does
        what ``a(from_a, to_a, n_a, stream)`` and ``b(from_b, to_b, n_b, stream)`` do.
        ``None`` where they cannot share a launch (another device or word size, no planes).
        Stream: as the two calls, both on ``stream``."""
        if not (isinstance(a, _PreparedCarry) and isinstance(b, _PreparedCarry)) or a._backend is not self \
                or b._backend is not self:
            return None
        if (a._index, a._word, a._words) != (b._index, b._word, b._words) or a._planes <= 0 or b._planes <= 0:
            return None
        return _PreparedCarryPair(self, a, b)

    def _launch_many(self, op: str, tables: Sequence[torch.Tensor], ids: IndexBatch,
                     planes: torch.Tensor, stream: "torch.cuda.Stream") -> None:
        """``op`` for up to :data:`MANY` tables per launch over the planes of ``planes``."""
        n = len(ids)
        if n == 0 or not tables:
            return
        prepared = self.prepare_many(op, tables, planes)
        prepared(ids.on_device(planes.device, stream).data_ptr(), n, stream)

    def carry_many(self, src: torch.Tensor, dst: torch.Tensor, planes: int, src_rows: int,
                   dst_rows: int, n: int, stream: "torch.cuda.Stream") -> None:
        """``dst[g, dst_rows[j]] = src[g, src_rows[j]]`` for planes ``g < planes`` and
        ``j < n``, in one launch.

        ``src`` and ``dst`` are ``(G, cap, dim)`` device buffers of one dtype with at
        least ``planes`` planes (rows contiguous, planes may be strided; capacities may
        differ) that do not overlap; ``src_rows``/``dst_rows`` are the device addresses of
        ``n`` int64 row indices each. Stream: the launch runs on ``stream``; the caller
        orders it after the producers of all four and keeps them alive until it has run.
        """
        if n <= 0 or planes <= 0:
            return
        self.prepare_carry(src, dst, planes)(src_rows, dst_rows, n, stream)

    def prepare_carry(self, src: torch.Tensor, dst: torch.Tensor, planes: int) -> "_PreparedCarry":
        """:meth:`carry_many` between fixed buffers, everything but the row indices and
        their count worked out once: ``prepared(src_rows, dst_rows, n, stream)``. The
        pipeline keeps one per pair of staging slots."""
        index = src.device.index
        isz = src.element_size()
        rb = src.shape[2] * isz
        sp, dp = src.stride(0) * isz, dst.stride(0) * isz
        word = word_bytes(rb, src.data_ptr(), dst.data_ptr(), sp, dp)
        return _PreparedCarry(self, index, word, rb // word, self._sms_of(index, "carry_many", word),
                              src.data_ptr(), dst.data_ptr(), sp // word, dp // word, planes)

    def scatter_last(self, table: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor,
                     stamps: torch.Tensor, bad: torch.Tensor, call: int,
                     stream: "torch.cuda.Stream") -> None:
        """``table[ids[j]] = rows[j]`` for a *device* ``table`` where a repeated id takes
        its last occurrence, in two launches on ``stream``, with no sort and no host sync.

        ``ids`` is ``(n,)`` int64 and ``rows`` ``(n, dim)`` contiguous, both on the
        table's device; ``stamps`` is an int64 scratch of one element per table row and
        ``bad`` a one-element int64 flag, both zero when first made and kept by the
        caller; ``call`` (>= 1) must grow by one per call with the same scratch. Ids are
        range-checked in the kernels: when any is outside ``[0, len(table))``, nothing is
        written and ``bad`` holds ``call << 32`` once ``stream`` gets here (the caller
        reads it). Stream: both launches on ``stream``; the caller orders it after the
        producers of ``ids`` and ``rows``.
        """
        n = int(ids.shape[0])
        if n == 0:
            return
        index = table.device.index
        rb = row_bytes(table)
        word = word_bytes(rb, table.data_ptr(), rows.data_ptr())
        words = rb // word
        base = call << 32
        blocks, threads = launch_shape(n, self._sms_of(index, "stamp_last", word))
        self._run(index, "stamp_last", word, (blocks, 1), threads, stream,
                  (ids.data_ptr(), stamps.data_ptr(), bad.data_ptr(), n, table.shape[0], base),
                  pointers=3)
        total = n * words
        blocks, threads = launch_shape(total, self._sms_of(index, "scatter_last", word))
        self._run(index, "scatter_last", word, (blocks, 1), threads, stream,
                  (table.data_ptr(), ids.data_ptr(), rows.data_ptr(), stamps.data_ptr(),
                   bad.data_ptr(), base, total, words), pointers=5)

    def gather_many(self, tables: Sequence[torch.Tensor], ids: IndexBatch, out: torch.Tensor,
                    stream: "torch.cuda.Stream") -> None:
        """``out[g, j] = tables[g][ids[j]]`` for every table, in one launch per 4 tables.

        ``out`` is ``(G, n, dim)`` on the device with contiguous rows (planes may be
        strided, e.g. ``buf[:, :n]`` of a ``(G, cap, dim)`` buffer); same stream contract
        as :meth:`gather`.
        """
        self._launch_many("gather", tables, ids, out, stream)

    def scatter_many(self, tables: Sequence[torch.Tensor], ids: IndexBatch, rows: torch.Tensor,
                     stream: "torch.cuda.Stream") -> None:
        """``tables[g][ids[j]] = rows[g, j]``; same layout as :meth:`gather_many`, same
        stream contract as :meth:`scatter`."""
        self._launch_many("scatter", tables, ids, rows, stream)

    def gather(self, table: torch.Tensor, ids: IndexBatch, out: torch.Tensor,
               stream: "torch.cuda.Stream") -> None:
        """``out[j] = table[ids[j]]`` by one kernel on ``stream`` (asynchronous).

        The kernel reads the page-locked ``table`` over UVA and the ids uploaded on
        ``stream``; ``out`` is valid on ``stream`` afterwards. The caller keeps ``table``
        registered until the kernel is done (the table's read event).
        """
        self._launch("gather", table, ids, out, stream)

    def scatter(self, table: torch.Tensor, ids: IndexBatch, rows: torch.Tensor,
                stream: "torch.cuda.Stream") -> None:
        """``table[ids[j]] = rows[j]`` by one kernel on ``stream`` (asynchronous).

        The write is complete once ``stream`` reaches this point (the table records its
        write event there); the caller keeps ``rows`` alive (``record_stream``).
        """
        self._launch("scatter", table, ids, rows, stream)

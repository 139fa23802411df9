# cython: language_level=3
"""CUDA driver calls and host packing made without Python objects (private).

Per batch the pipeline launches a few kernels, packs its index arrays into the pinned
upload ring and copies them to the device. In cProfile on the H200 host (2M-row skip-gram,
2026-12-03) a kernel launch through ``ctypes`` cost about 30 us, the ring's
``Tensor.copy_`` to the device 45 us (PyTorch also records an event for its caching host
allocator on every copy out of its pinned memory), and the numpy packing held the GIL
for its memcpys while the training thread waited for it. Here:

* :func:`launch` calls ``cuLaunchKernel`` through a function pointer, the 64-bit kernel
  parameters in a C array. It keeps the GIL: a launch takes a few microseconds, less than
  handing the GIL to another thread and back.
* :func:`htod` calls ``cuMemcpyHtoDAsync`` with the GIL released.
* :func:`pack` copies the bytes of C-contiguous buffers to a host address with the GIL
  released, so the training thread runs while the prefetch thread packs;
  :func:`pack_htod` also enqueues the copy of the packed bytes to the device, in the
  same release.

The driver's entry points are given to :func:`bind` as addresses (looked up with
``ctypes`` by :func:`stpipe._cuda.driver_calls`), so this module compiles and imports on
machines without CUDA; unbound, :func:`launch` and :func:`htod` return ``-1``. Their
pure-Python twins: ``stpipe.kernels._cupy._DriverLaunch`` (ctypes), ``Tensor.copy_`` and
``stpipe._staging._pack`` (numpy).

Streams: :func:`launch` and :func:`htod` enqueue on the raw ``CUstream`` handle given
(``torch.cuda.Stream.cuda_stream``) and return at once; the caller keeps every buffer
alive and unchanged until the stream has run the work.
"""
from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

ctypedef int (*launch_t)(void*, unsigned int, unsigned int, unsigned int, unsigned int,
                         unsigned int, unsigned int, unsigned int, void*, void**,
                         void**) noexcept nogil
ctypedef int (*htod_t)(unsigned long long, const void*, size_t, void*) noexcept nogil

cdef launch_t _launch = NULL
cdef htod_t _htod = NULL

#: Most kernel parameters :func:`launch` passes.
MAX_PARAMS = 16
cdef enum:
    _MAX = 16


def bind(uintptr_t launch_kernel, uintptr_t memcpy_htod_async) -> None:
    """Use the driver functions at these addresses (``cuLaunchKernel``,
    ``cuMemcpyHtoDAsync_v2``); ``bind(0, 0)`` unbinds."""
    global _launch, _htod
    _launch = <launch_t><void*>launch_kernel
    _htod = <htod_t><void*>memcpy_htod_async


def bound() -> bool:
    """Whether :func:`bind` gave both driver functions."""
    return _launch != NULL and _htod != NULL


def launch(uintptr_t func, unsigned int gx, unsigned int gy, unsigned int block,
           uintptr_t stream, values) -> int:
    """``cuLaunchKernel(func, (gx, gy, 1), (block, 1, 1), 0 shared bytes, stream)`` with
    ``values`` (each a non-negative integer below 2**64) as the kernel's 8-byte
    parameters. Returns the ``CUresult`` (0: launched), or -1 when unbound.

    Raises:
        ValueError: more than :data:`MAX_PARAMS` values.
        OverflowError: a value below 0 or above 2**64 - 1.
    """
    cdef uint64_t vals[_MAX]
    cdef void* params[_MAX]
    cdef Py_ssize_t i, n = len(values)
    if n > _MAX:
        raise ValueError(f"expected at most {_MAX} kernel parameters, got {n}")
    for i in range(n):
        vals[i] = values[i]
        params[i] = &vals[i]
    if _launch == NULL:
        return -1
    return _launch(<void*>func, gx, gy, 1, block, 1, 1, 0, <void*>stream, params, NULL)


def htod(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream) -> int:
    """``cuMemcpyHtoDAsync(dst, src, nbytes, stream)`` with the GIL released; returns the
    ``CUresult`` (0: enqueued), or -1 when unbound. ``src`` should be page-locked (from
    pageable memory the driver may synchronise)."""
    cdef int err
    if _htod == NULL:
        return -1
    with nogil:
        err = _htod(dst, <const void*>src, nbytes, <void*>stream)
    return err


def pack_htod(uintptr_t dst, arrays, offsets, uintptr_t dev, size_t nbytes, uintptr_t stream) -> int:
    """:func:`pack` to the pinned host address ``dst``, then
    ``cuMemcpyHtoDAsync(dev, dst, nbytes, stream)``, in one release of the GIL (each
    release may hand the GIL to the training thread and wait to take it back). Returns
    the ``CUresult`` of the copy (0: enqueued), or -1 when unbound (packed, not copied).

    Raises:
        as :func:`pack` (nothing packed or copied then).
    """
    return _pack(dst, arrays, offsets, dev, nbytes, stream, True)


def pack(uintptr_t dst, arrays, offsets) -> int:
    """Copy the bytes of each of ``arrays`` (C-contiguous buffers: numpy arrays, bytes)
    to the host address ``dst + offsets[i]``, with the GIL released for the copies.
    Returns the bytes copied. The caller owns ``dst`` and makes sure every region fits.

    Raises:
        ValueError: ``arrays`` and ``offsets`` differ in length, or an offset is negative.
        ValueError, BufferError: an array that is not C-contiguous (the exporter's
            error: numpy raises ``ValueError``).
    """
    return _pack(dst, arrays, offsets, 0, 0, 0, False)


cdef object _pack(uintptr_t dst, arrays, offsets, uintptr_t dev, size_t nbytes, uintptr_t stream, bint copy):
    cdef Py_ssize_t n = len(arrays), i, got = 0
    cdef size_t total = 0
    cdef int err = -1
    if len(offsets) != n:
        raise ValueError(f"expected one offset per array ({n}), got {len(offsets)}")
    if n == 0:
        if copy and _htod != NULL and nbytes:
            with nogil:
                err = _htod(dev, <const void*>dst, nbytes, <void*>stream)
            return err
        return -1 if copy else 0
    cdef Py_buffer* bufs = <Py_buffer*>malloc(n * sizeof(Py_buffer))
    cdef size_t* offs = <size_t*>malloc(n * sizeof(size_t))
    if bufs == NULL or offs == NULL:
        free(bufs)
        free(offs)
        raise MemoryError()
    try:
        for i in range(n):
            if offsets[i] < 0:
                raise ValueError(f"offsets must be >= 0, got {offsets[i]} at position {i}")
            offs[i] = offsets[i]
        for i in range(n):
            PyObject_GetBuffer(arrays[i], &bufs[i], PyBUF_C_CONTIGUOUS)
            got += 1
        with nogil:
            for i in range(n):
                memcpy(<char*>dst + offs[i], bufs[i].buf, <size_t>bufs[i].len)
                total += <size_t>bufs[i].len
            if copy and _htod != NULL:
                err = _htod(dev, <const void*>dst, nbytes, <void*>stream)
    finally:
        for i in range(got):
            PyBuffer_Release(&bufs[i])
        free(bufs)
        free(offs)
    return err if copy else total

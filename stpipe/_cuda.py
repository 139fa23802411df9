"""Page-locking ordinary host memory with ``cudaHostRegister`` (private).

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which
rounds a request up to a power of two (a 5.12 GB table took 9.2 GB of RSS and 4 s). stpipe
instead allocates ordinary memory at exact size and page-locks it in place with
``cudaHostRegister``, in chunks of :data:`REGISTER_CHUNK` bytes, through PyTorch's own
binding of the CUDA runtime (``torch.cuda.cudart()``), so no extra package is needed.

Registered memory is mapped into the device address space. On 64-bit systems with unified
virtual addressing (every GPU CUDA 12+ supports) the host pointer itself is the device
pointer, which is how the UVA kernels of :mod:`stpipe.kernels` read and write it.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Dict, List, Optional, Tuple

import torch

from ._errors import BackendUnavailableError, StpipeRuntimeError

#: cudaErrorHostMemoryAlreadyRegistered
ALREADY_REGISTERED = 712

__all__ = ["REGISTER_CHUNK", "PAGE", "host_register", "host_unregister", "cuda_available",
           "driver_calls"]

#: Bytes page-locked by one ``cudaHostRegister`` call.
REGISTER_CHUNK = 1 << 30
#: Alignment of registered ranges (the x86-64 / aarch64 base page is at most 64 KiB;
#: 4 KiB is the common case and what register ranges are rounded to here).
PAGE = 4096

# cudaHostRegisterPortable (1): pinned for every CUDA context;
# cudaHostRegisterMapped (2): mapped into the device address space (UVA access).
_FLAGS = 1 | 2


# Ranges page-locked through this module: start -> end. Lets a table that wraps memory
# another table registered skip registering it again (which fails).
_registered: Dict[int, int] = {}
_reg_lock = threading.Lock()
_libcudart: Optional[ctypes.CDLL] = None


def is_registered(ptr: int, nbytes: int) -> bool:
    """True when ``[ptr, ptr + nbytes)`` lies inside ranges stpipe page-locked."""
    with _reg_lock:
        spans = sorted(_registered.items())
    pos, end = ptr, ptr + nbytes
    for start, stop in spans:
        if start <= pos < stop:
            pos = stop
            if pos >= end:
                return True
    return False


def _clear_last_error() -> None:
    """Reset the runtime's per-thread last error after a failed call we handled.

    A failed ``cudaHostRegister`` leaves its error as the runtime's "last error", which
    PyTorch's next error check would report against an unrelated call. PyTorch's binding
    has no ``cudaGetLastError``, so call it in the libcudart that PyTorch loaded.
    """
    global _libcudart
    if _libcudart is None:
        try:
            with open("/proc/self/maps") as f:
                paths = [ln.split()[-1] for ln in f if "libcudart.so" in ln]
            if not paths:
                return
            _libcudart = ctypes.CDLL(paths[0])
        except OSError:
            return
    _libcudart.cudaGetLastError()


def cuda_available() -> bool:
    """True when a CUDA device can be used (never raises)."""
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - broken driver installs
        return False


def _cudart():
    try:
        return torch.cuda.cudart()
    except Exception as exc:  # pragma: no cover - needs a broken CUDA install
        raise BackendUnavailableError(
            f"cannot load the CUDA runtime through torch.cuda.cudart(): {exc}; "
            "use pin=False or a CUDA build of PyTorch"
        ) from exc


def _check(rt, err, what: str) -> None:
    code = int(getattr(err, "value", err))
    if code != 0:
        _clear_last_error()
        try:
            msg = rt.cudaGetErrorString(err)
        except Exception:  # pragma: no cover
            msg = "unknown error"
        exc = StpipeRuntimeError(f"{what} failed with CUDA error {code}: {msg}")
        exc.cuda_error = code  # type: ignore[attr-defined]
        raise exc


def host_register(ptr: int, nbytes: int, chunk: int = REGISTER_CHUNK) -> List[Tuple[int, int]]:
    """Page-lock ``[ptr, ptr + nbytes)`` in chunks; all or nothing.

    Args:
        ptr: start address (page aligned for memory stpipe allocates; any address for
            memory it wraps).
        nbytes: bytes to lock (stpipe rounds its own allocations up to whole pages).
        chunk: bytes per ``cudaHostRegister`` call (a multiple of :data:`PAGE`); chunk
            boundaries are page aligned so that no two registrations share a page.

    Returns:
        The registered ``(ptr, nbytes)`` ranges, for :func:`host_unregister`.

    Raises:
        BackendUnavailableError: the CUDA runtime cannot be loaded.
        StpipeRuntimeError: a ``cudaHostRegister`` call failed; ranges registered before
            it are unregistered again.
    """
    if chunk % PAGE or chunk <= 0:
        raise StpipeRuntimeError(f"chunk must be a positive multiple of {PAGE}, got {chunk}")
    rt = _cudart()
    done: List[Tuple[int, int]] = []
    # Chunk boundaries sit on page boundaries, so no two registrations share a page.
    bounds = [ptr] + list(range((ptr // PAGE) * PAGE + chunk, ptr + nbytes, chunk)) + [ptr + nbytes]
    try:
        for a, b in zip(bounds, bounds[1:]):
            start, size = a - ptr, b - a
            err = rt.cudaHostRegister(ptr + start, size, _FLAGS)
            _check(rt, err, f"cudaHostRegister({ptr + start:#x}, {size})")
            done.append((ptr + start, size))
            with _reg_lock:
                _registered[ptr + start] = ptr + start + size
    except BaseException:
        host_unregister(done)
        raise
    return done


def host_unregister(ranges: List[Tuple[int, int]]) -> None:
    """Undo :func:`host_register`; every range is tried, the first error is raised.

    Raises:
        StpipeRuntimeError: a ``cudaHostUnregister`` call failed.
    """
    if not ranges:
        return
    rt = _cudart()
    first: BaseException | None = None
    for p, size in ranges:
        with _reg_lock:
            _registered.pop(p, None)
        try:
            _check(rt, rt.cudaHostUnregister(p), f"cudaHostUnregister({p:#x}, {size})")
        except BaseException as exc:  # keep going: free what we can
            first = first or exc
    ranges.clear()
    if first is not None:
        raise first


_DRIVER_CALLS: object = None  # None: not looked up yet; False: unavailable
_DRIVER_ENV = "STPIPE_DRIVER_CALLS"


def driver_calls():
    """The compiled driver calls (:mod:`stpipe._calls`) bound to this process's CUDA
    driver, or ``None``: extension not built, no ``libcuda.so.1``, or
    ``STPIPE_DRIVER_CALLS=0`` (callers then take their pure-Python paths). Looked up once.
    """
    global _DRIVER_CALLS
    if _DRIVER_CALLS is None:
        with _reg_lock:
            if _DRIVER_CALLS is None:
                _DRIVER_CALLS = _bind_driver_calls() or False
    return _DRIVER_CALLS or None


_COMPILED_CALLS: object = None  # None: not looked up yet; False: unavailable


def compiled_calls():
    """:mod:`stpipe._calls`, bound to a driver or not (its packing needs no CUDA), or
    ``None``: extension not built, or ``STPIPE_DRIVER_CALLS=0``. Looked up once."""
    global _COMPILED_CALLS
    if _COMPILED_CALLS is None:
        import os

        calls = False
        if os.environ.get(_DRIVER_ENV, "1").strip() != "0":
            try:
                from . import _calls as calls
            except ImportError:  # pragma: no cover - depends on the build
                calls = False
        _COMPILED_CALLS = calls
    return _COMPILED_CALLS or None


def _bind_driver_calls():
    _calls = compiled_calls()
    if _calls is None:
        return None
    if not _calls.bound():
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            launch = ctypes.cast(lib.cuLaunchKernel, ctypes.c_void_p).value
            htod = ctypes.cast(lib.cuMemcpyHtoDAsync_v2, ctypes.c_void_p).value
        except (OSError, AttributeError):
            return None
        _calls.bind(launch, htod)
    return _calls

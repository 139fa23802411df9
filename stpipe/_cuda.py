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

from typing import List, Tuple

import torch

from ._errors import BackendUnavailableError, StpipeRuntimeError

__all__ = ["REGISTER_CHUNK", "PAGE", "host_register", "host_unregister", "cuda_available"]

#: Bytes page-locked by one ``cudaHostRegister`` call.
REGISTER_CHUNK = 1 << 30
#: Alignment of registered ranges (the x86-64 / aarch64 base page is at most 64 KiB;
#: 4 KiB is the common case and what register ranges are rounded to here).
PAGE = 4096

# cudaHostRegisterPortable (1): pinned for every CUDA context;
# cudaHostRegisterMapped (2): mapped into the device address space (UVA access).
_FLAGS = 1 | 2


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
        try:
            msg = rt.cudaGetErrorString(err)
        except Exception:  # pragma: no cover
            msg = "unknown error"
        raise StpipeRuntimeError(f"{what} failed with CUDA error {code}: {msg}")


def host_register(ptr: int, nbytes: int, chunk: int = REGISTER_CHUNK) -> List[Tuple[int, int]]:
    """Page-lock ``[ptr, ptr + nbytes)`` in chunks; all or nothing.

    Args:
        ptr: start address, a multiple of :data:`PAGE`.
        nbytes: bytes to lock, a multiple of :data:`PAGE` (callers round up inside their
            own allocation).
        chunk: bytes per ``cudaHostRegister`` call (a multiple of :data:`PAGE`).

    Returns:
        The registered ``(ptr, nbytes)`` ranges, for :func:`host_unregister`.

    Raises:
        BackendUnavailableError: the CUDA runtime cannot be loaded.
        StpipeRuntimeError: a ``cudaHostRegister`` call failed; ranges registered before
            it are unregistered again.
    """
    if ptr % PAGE or nbytes % PAGE or chunk % PAGE:
        raise StpipeRuntimeError(
            f"host_register needs page-aligned ranges, got ptr={ptr:#x} nbytes={nbytes}"
        )
    rt = _cudart()
    done: List[Tuple[int, int]] = []
    try:
        for start in range(0, nbytes, chunk):
            size = min(chunk, nbytes - start)
            err = rt.cudaHostRegister(ptr + start, size, _FLAGS)
            _check(rt, err, f"cudaHostRegister({ptr + start:#x}, {size})")
            done.append((ptr + start, size))
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
        try:
            _check(rt, rt.cudaHostUnregister(p), f"cudaHostUnregister({p:#x}, {size})")
        except BaseException as exc:  # keep going: free what we can
            first = first or exc
    ranges.clear()
    if first is not None:
        raise first

"""Gather/scatter backends: move rows between a host table and a CUDA device.

A backend copies ``out[j, :] = table[ids[j], :]`` (gather, host -> device) and
``table[ids[j], :] = rows[j, :]`` (scatter, device -> host). Backends take raw tensors and
an :class:`IndexBatch`, never tables: validation, ordering against earlier accesses
(events) and memory ownership are the caller's (:class:`stpipe.host.HostTable`) job.

Backends (``get_backend(name)``):

* ``"torch"``: multi-threaded CPU ``index_select`` into double-buffered pinned staging,
  each chunk's DMA overlapping the next chunk's CPU gather; the reverse for scatter.
  Works with any host table, pinned or not. Always available.
* ``"cupy"``: a UVA ``cupy.RawKernel`` reading/writing page-locked host memory directly.
* ``"numba"``: the same kernels written with ``numba.cuda.jit``.
* ``"auto"`` (default): measures the available backends (and a hybrid that splits a batch
  between a UVA kernel and the torch path) on first use per size class, then reuses the
  winner.

CuPy and numba are imported only when their backend is first asked for; a missing or
broken install raises :class:`~stpipe.BackendUnavailableError` at that point.

Every backend call is asynchronous with respect to the host only as far as its
docstring says; all GPU work runs on the ``stream`` passed in (a ``torch.cuda.Stream``).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Dict, Optional, Protocol

import numpy as np
import torch

from .._errors import BackendUnavailableError, StpipeValueError

__all__ = [
    "BACKENDS",
    "Backend",
    "IndexBatch",
    "get_backend",
    "available_backends",
    "row_bytes",
]

#: Names accepted by :func:`get_backend`.
BACKENDS = ("auto", "torch", "cupy", "numba")

#: dtypes the kernels move (as raw bytes).
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row of a 2-d tensor ``(n, dim)``."""
    return int(t.shape[1]) * t.element_size()


@dataclass
class IndexBatch:
    """Validated row ids of one call, on the host and (lazily) on a device.

    Attributes:
        host: ``(n,)`` int64 numpy array, every id in range (checked by the caller).
        device_ids: an optional ``(n,)`` int64 CUDA tensor holding the same ids (the
            caller's own tensor when it passed one); see :meth:`on_device`.
        is_sorted: ``host`` is non-decreasing (the planner's ``unique`` is).
        checked_rows: the row count ``host`` was already range-checked against (``-1``:
            not checked); a table of that many rows skips its own check.
    """

    host: np.ndarray
    device_ids: Optional[torch.Tensor] = None
    is_sorted: bool = False
    checked_rows: int = -1
    _uploaded: Dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, host: np.ndarray, device_ids: Optional[torch.Tensor] = None,
           checked_rows: int = -1) -> "IndexBatch":
        """An IndexBatch of the ``(n,)`` int64 ``host`` ids, finding whether they are sorted."""
        is_sorted = host.shape[0] < 2 or bool(np.all(host[1:] >= host[:-1]))
        return cls(host=host, device_ids=device_ids, is_sorted=is_sorted, checked_rows=checked_rows)

    def __len__(self) -> int:
        return int(self.host.shape[0])

    def cpu(self, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        """A CPU int64 tensor sharing memory with ``host[start:stop]`` (a copy when the
        ids are read-only: ``torch.from_numpy`` warns about those, and nothing writes
        through ids anyway)."""
        h = self.host[start:stop]
        if not h.flags.writeable:
            h = h.copy()
        return torch.from_numpy(h)

    def on_device(self, device: torch.device, stream: "torch.cuda.Stream") -> torch.Tensor:
        """The ids as a ``(n,)`` int64 tensor on ``device``, valid on ``stream``.

        A caller-supplied CUDA tensor on that device is returned as is (the caller made
        ``stream`` wait for its producer). Otherwise the host ids are copied on ``stream``
        through stpipe's pinned upload ring (:func:`stpipe._staging.upload`: one async
        H2D copy that never synchronises the stream, unlike a copy from pageable memory).
        The copy is allocated on ``stream`` and cached per stream, so a second use on
        another stream uploads again rather than sharing memory across streams.
        """
        d = self.device_ids
        if d is not None and d.device == device:
            if d.dtype != torch.int64:
                d = d.to(torch.int64)
            return d.contiguous()
        key = int(stream.cuda_stream)
        got = self._uploaded.get(key)
        if got is None:
            from .._staging import upload

            got = upload([self.host], device, stream)[0]
            self._uploaded[key] = got
        return got


class Backend(Protocol):
    """What every backend offers (see the module docstring)."""

    #: backend name, one of :data:`BACKENDS` (``"auto"`` reports what it chose).
    name: str
    #: True when the backend reads/writes host memory from CPU threads, so the caller
    #: must ``synchronize()`` pending GPU accesses to the table before calling it.
    uses_cpu: bool
    #: True when the backend reads/writes host memory from the GPU (UVA), which needs
    #: the table page-locked.
    needs_pinned: bool

    def gather(self, table: torch.Tensor, ids: IndexBatch, out: torch.Tensor,
               stream: "torch.cuda.Stream") -> None:
        """``out[j] = table[ids[j]]``; ``table`` ``(num_rows, dim)`` host, ``out`` ``(n, dim)``
        CUDA, contiguous, same dtype. Rows of ``out`` are valid on ``stream`` when it
        returns."""

    def scatter(self, table: torch.Tensor, ids: IndexBatch, rows: torch.Tensor,
                stream: "torch.cuda.Stream") -> None:
        """``table[ids[j]] = rows[j]``; ids unique; ``rows`` ``(n, dim)`` CUDA contiguous,
        read on ``stream``. The write is complete once work queued on ``stream`` so far
        has run (host-synchronous backends finish before returning)."""


_lock = threading.Lock()
_cache: Dict[str, "Backend"] = {}


def get_backend(name: str) -> "Backend":
    """Return the (shared, cached) backend called ``name``.

    Args:
        name: one of :data:`BACKENDS`.

    Returns:
        The backend object; backends hold compiled-kernel and staging caches, so one
        instance serves every table.

    Raises:
        StpipeValueError: unknown name.
        BackendUnavailableError: the backend's package (CuPy, numba-cuda) or CUDA itself
            is missing or broken; the message says what to install.
    """
    if not isinstance(name, str) or name not in BACKENDS:
        raise StpipeValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    with _lock:
        got = _cache.get(name)
        if got is not None:
            return got
    if name == "torch":
        from ._torch import TorchBackend as cls
    elif name == "cupy":
        from ._cupy import CupyBackend as cls
    elif name == "numba":
        from ._numba import NumbaBackend as cls
    else:
        from ._auto import AutoBackend as cls
    backend = cls()  # may raise BackendUnavailableError
    with _lock:
        return _cache.setdefault(name, backend)


def available_backends() -> list:
    """Names of the backends that load here (imports CuPy/numba to find out)."""
    out = []
    for name in BACKENDS:
        try:
            get_backend(name)
        except BackendUnavailableError:
            continue
        out.append(name)
    return out

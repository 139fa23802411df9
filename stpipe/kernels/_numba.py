"""The ``numba`` backend: the UVA gather/scatter kernels written with ``numba.cuda.jit``.

Same logic as the CuPy backend (:mod:`stpipe.kernels._cupy`): one thread per machine
word of the flattened ``(n, words_per_row)`` rows, grid-stride, rows copied as raw
words (dtype-agnostic, bit-exact). numba has no 16-byte vector loads on plain arrays, so
the widest word here is 8 bytes (``int64``), then 4 and 2.

Buffers reach numba as ``__cuda_array_interface__`` views made from raw pointers
(``numba.cuda.from_cuda_array_interface(..., sync=False)``): the host table through its
UVA pointer, ``out``/``rows`` and the ids through their torch device pointers. Kernels
launch on ``numba.cuda.external_stream(stream.cuda_stream)``, the caller's torch stream.

numba is imported on first use of the backend. Dispatchers are created once per device
and word size; numba compiles each on first launch.
"""
from __future__ import annotations

import threading
from typing import Dict, Tuple

import numpy as np
import torch

from .._errors import BackendUnavailableError, StpipeRuntimeError
from . import IndexBatch, row_bytes
from ._cupy import launch_shape

__all__ = ["NumbaBackend"]

_TYPESTR = {8: "<i8", 4: "<i4", 2: "<i2"}


def _import_numba_cuda():
    """Import numba.cuda, working around numba-cuda's use of ``np.row_stack``."""
    # numba-cuda (0.30.x) overloads np.row_stack in np/arrayobj.py, which numpy 2.5
    # removed; the import then fails with "module 'numpy' has no attribute 'row_stack'"
    # and no kernel compiles. row_stack was an alias of vstack, so restoring the alias
    # before numba.cuda loads is exact. Kept here so that only this backend touches numpy.
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack
    from numba import config, cuda

    # The kernels grid-stride and small batches get small grids on purpose; numba would
    # warn "Grid size N will likely result in GPU under-utilization" on every such launch.
    config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
    return cuda


def _make_kernels(cuda):
    @cuda.jit
    def gather(table, ids, out, words):
        k = cuda.grid(1)
        stride = cuda.gridsize(1)
        total = out.shape[0]
        while k < total:
            row = k // words
            w = k - row * words
            out[k] = table[ids[row] * words + w]
            k += stride

    @cuda.jit
    def scatter(table, ids, rows, words):
        k = cuda.grid(1)
        stride = cuda.gridsize(1)
        total = rows.shape[0]
        while k < total:
            row = k // words
            w = k - row * words
            table[ids[row] * words + w] = rows[k]
            k += stride

    return gather, scatter


class NumbaBackend:
    """UVA kernels through numba-cuda (see the module docstring).

    Raises:
        BackendUnavailableError: numba / numba-cuda is missing, broken, or sees no GPU.
    """

    name = "numba"
    uses_cpu = False
    needs_pinned = True

    def __init__(self) -> None:
        try:
            cuda = _import_numba_cuda()
            if not cuda.is_available():
                raise RuntimeError("numba.cuda.is_available() is False")
        except Exception as exc:
            raise BackendUnavailableError(
                f"the numba backend needs numba with numba-cuda and a working CUDA "
                f"({type(exc).__name__}: {exc}); install numba-cuda[cu12] or "
                "numba-cuda[cu13], or use backend='torch' / 'cupy'"
            ) from None
        self._cuda = cuda
        self._lock = threading.Lock()
        self._kernels: Dict[Tuple[int, int], tuple] = {}
        self._sms: Dict[int, int] = {}

    def _get(self, device: int, word: int) -> tuple:
        key = (device, word)
        got = self._kernels.get(key)
        if got is None:
            with self._lock:
                got = self._kernels.get(key)
                if got is None:
                    got = _make_kernels(self._cuda)
                    self._kernels[key] = got
                    props = torch.cuda.get_device_properties(device)
                    self._sms[device] = props.multi_processor_count
        return got

    def _view(self, ptr: int, count: int, typestr: str):
        desc = {"shape": (count,), "typestr": typestr, "data": (ptr, False), "version": 3,
                "strides": None}
        return self._cuda.from_cuda_array_interface(desc, owner=None, sync=False)

    def _launch(self, op: str, table: torch.Tensor, ids: IndexBatch, dev_buf: torch.Tensor,
                stream: "torch.cuda.Stream") -> None:
        n = len(ids)
        if n == 0:
            return
        device = dev_buf.device
        rb = row_bytes(table)
        tptr, bptr = table.data_ptr(), dev_buf.data_ptr()
        word = next((w for w in (8, 4, 2) if rb % w == 0 and tptr % w == 0 and bptr % w == 0), 0)
        if not word:
            raise StpipeRuntimeError(f"rows of {rb} bytes are not 2-byte aligned")
        words = rb // word
        total = n * words
        gather, scatter = self._get(device.index, word)
        blocks, threads = launch_shape(total, self._sms[device.index])
        id_t = ids.on_device(device, stream)
        ts = _TYPESTR[word]
        cuda = self._cuda
        with cuda.gpus[device.index]:
            tab = self._view(tptr, table.shape[0] * words, ts)
            buf = self._view(bptr, total, ts)
            idv = self._view(id_t.data_ptr(), n, "<i8")
            s = cuda.external_stream(stream.cuda_stream)
            kern = gather if op == "gather" else scatter
            kern[blocks, threads, s](tab, idv, buf, np.int64(words))

    def gather(self, table: torch.Tensor, ids: IndexBatch, out: torch.Tensor,
               stream: "torch.cuda.Stream") -> None:
        """``out[j] = table[ids[j]]`` by one kernel on ``stream`` (asynchronous); see
        :meth:`stpipe.kernels._cupy.CupyBackend.gather` for the memory contract."""
        self._launch("gather", table, ids, out, stream)

    def scatter(self, table: torch.Tensor, ids: IndexBatch, rows: torch.Tensor,
                stream: "torch.cuda.Stream") -> None:
        """``table[ids[j]] = rows[j]`` by one kernel on ``stream`` (asynchronous); see
        :meth:`stpipe.kernels._cupy.CupyBackend.scatter`."""
        self._launch("scatter", table, ids, rows, stream)

"""``HostTable``: an embedding table in exact-size, page-locked host memory.

The table is ordinary host memory (``torch.empty`` of bytes, page aligned, exact size up
to two pages), page-locked in place with ``cudaHostRegister`` in 1 GiB chunks when CUDA
is available (see :mod:`stpipe._cuda`). Rows move to and from a CUDA device through a
backend of :mod:`stpipe.kernels`; on a CPU-only machine the same class gathers and
scatters with plain ``index_select`` / ``index_copy_``.

Ordering. The table orders its own accesses, so callers need no device-wide syncs:

* after every scatter that writes host memory from the GPU (UVA kernels) it records a
  *write event* on the scatter's stream; a later GPU gather makes its stream wait on it
  (``stream.wait_event``), a later CPU access (torch backend, ``numpy()``, ``save()``,
  initialisers) blocks on it (``event.synchronize()``);
* after every gather that reads host memory from the GPU it records a *read event*; a
  later scatter waits on all read events since the last write (no write-after-read race);
* CPU-side backends (torch) finish their host accesses before returning, so they record
  nothing.

Example::

    >>> import torch
    >>> from stpipe.host import HostTable
    >>> t = HostTable(1000, 4, device="cpu").uniform_(-0.1, 0.1)
    >>> rows = t.gather([3, 7])                 # (2, 4) on t.device
    >>> t.scatter([3, 7], rows * 0)             # ids must be unique
    >>> float(t.tensor()[3].abs().sum())
    0.0
"""
from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from . import _cuda
from ._io import NpyHeaderError, atomic_write, read_npy_header
from ._errors import (
    BackendUnavailableError,
    StpipeRuntimeError,
    StpipeTypeError,
    StpipeValueError,
)
from .kernels import BACKENDS, SUPPORTED_DTYPES, IndexBatch, get_backend
from .planner import check_ids, first_repeat, scan_ids
from ._streams import current_stream

__all__ = ["HostTable"]

#: Bytes per chunk of initialisers, copies and file I/O.
_CHUNK_BYTES = 64 << 20

_DTYPE_NAMES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}
# .npy descr of each dtype on disk; bfloat16 has no numpy dtype and is stored as its raw
# bits in a little-endian uint16 array ('<u2'). load() reads every '<u2' file as bfloat16.
_NPY_DESCR = {torch.float32: "<f4", torch.float16: "<f2", torch.bfloat16: "<u2"}
_DESCR_DTYPE = {v: k for k, v in _NPY_DESCR.items()}

DeviceLike = Union[str, torch.device, int, None]


def _as_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, str):
        got = _DTYPE_NAMES.get(dtype.lower().replace("torch.", ""))
    elif isinstance(dtype, torch.dtype):
        got = dtype
    else:
        try:
            got = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}.get(
                np.dtype(dtype)
            )
        except TypeError:
            got = None
    if got not in SUPPORTED_DTYPES:
        raise StpipeTypeError(
            f"dtype must be float32, float16 or bfloat16, got {dtype!r}"
        )
    return got


def _as_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise StpipeTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if int(value) <= 0:
        raise StpipeValueError(f"{name} must be > 0, got {int(value)}")
    return int(value)


def _from_numpy_chunk(part: np.ndarray) -> torch.Tensor:
    """A (possibly memory-mapped) numpy chunk as a tensor torch can copy from.

    torch takes native byte order only and floats up to float64, so a big-endian chunk
    is swapped and a ``longdouble`` one narrowed to float64 (the table's dtype is
    narrower still); other dtypes keep their kind. A chunk torch can take as it is
    (contiguous, writable) is wrapped without a copy; a read-only one (a memory-mapped
    file's) is copied, as ``torch.from_numpy`` warns on those.
    """
    dt = part.dtype
    want = np.dtype(np.float64) if dt.kind == "f" and dt.itemsize > 8 else dt.newbyteorder("=")
    if dt == want and part.flags.c_contiguous and part.flags.writeable:
        return torch.from_numpy(part)
    return torch.from_numpy(np.array(part, dtype=want, copy=True, order="C"))


def _resolve_device(device: DeviceLike, cuda: bool) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise StpipeValueError(f"device must be 'cpu' or a CUDA device, got {device!r} ({exc})") from None
    if dev.type == "cuda":
        if not cuda:
            raise BackendUnavailableError(
                f"device {dev} asked for but CUDA is not available here; use device='cpu'"
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise StpipeValueError(f"device must be 'cpu' or a CUDA device, got {dev}")
    else:
        dev = torch.device("cpu")  # "cpu:0" too: CPU tensors report plain "cpu"
    return dev


class _Abort(Exception):
    pass


def _record_init(fn: Callable[..., Any], shape: Tuple[int, int], dtype: torch.dtype,
                 args: tuple, kwargs: dict) -> Tuple[List[tuple], Optional[str]]:
    """Run ``fn`` on a zero-stride stand-in of the full table and record its in-place ops.

    The stand-in has the table's full shape (so fan-in/fan-out come out right) but one
    element of memory. A dispatch mode intercepts every aten op on it: in-place ops with
    scalar arguments are recorded (not run) for replay chunk by chunk; any other op on it
    aborts and is reported.

    Returns:
        ``(calls, bad)``: the recorded ``(op, args, kwargs)`` and the name of the first op
        that cannot be replayed chunk-wise (None when all could).
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    stand_in = torch.empty(1, dtype=dtype).expand(*shape)

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: List[tuple] = []
            self.bad: Optional[str] = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            flat = list(args) + list(kwargs.values())
            if any(a is stand_in for a in flat):
                schema = func._schema
                first = schema.arguments[0] if schema.arguments else None
                inplace = (
                    bool(args) and args[0] is stand_in and first is not None
                    and first.alias_info is not None and first.alias_info.is_write
                    and not any(isinstance(a, torch.Tensor) and a.dim() > 0 for a in flat[1:])
                )
                if inplace:
                    self.calls.append((func, tuple(args[1:]), dict(kwargs)))
                    return stand_in
                self.bad = str(func)
                raise _Abort
            return func(*args, **kwargs)

    rec = Recorder()
    try:
        with torch.no_grad(), rec:
            fn(stand_in, *args, **kwargs)
    except _Abort:
        pass
    return rec.calls, rec.bad


# Elementwise initialisers that do not depend on the shape but cannot be replayed op by op
# (rejection sampling): applied to each chunk as they are.
_CHUNKWISE_OK = {"trunc_normal_", "uniform_", "normal_", "constant_", "zeros_", "ones_"}


class HostTable:
    """A ``(num_rows, dim)`` table in page-locked host memory, moved row-wise to a device.

    Args:
        num_rows: rows of the table (> 0).
        dim: columns of the table (> 0).
        dtype: ``torch.float32``, ``torch.float16`` or ``torch.bfloat16`` (or their names).
        device: where gathered rows go and scattered rows come from; default the current
            CUDA device when CUDA is available, else ``cpu``.
        pin: page-lock the table (``cudaHostRegister``); default True when CUDA is
            available. The UVA backends (``cupy``, ``numba``) need it.
        backend: ``"auto"`` (default), ``"torch"``, ``"cupy"`` or ``"numba"``; see
            :mod:`stpipe.kernels`. Ignored for a CPU ``device``.

    Memory starts uninitialised; call an initialiser (``zeros_()``, ``uniform_()``, ...).

    Raises:
        StpipeTypeError: non-integer sizes or an unsupported dtype.
        StpipeValueError: non-positive sizes, unknown backend, a UVA backend with
            ``pin=False``.
        BackendUnavailableError: a CUDA device or ``pin=True`` without CUDA, or the asked
            backend's package (CuPy, numba-cuda) is missing or broken.
        StpipeRuntimeError: ``cudaHostRegister`` failed (e.g. the locked-memory limit).
    """

    def __init__(self, num_rows: int, dim: int, dtype: Any = torch.float32, *,
                 device: DeviceLike = None, pin: Optional[bool] = None,
                 backend: str = "auto") -> None:
        self._closed = True  # until fully built; close() and __del__ rely on it
        self._ranges: List[Tuple[int, int]] = []
        pin = self._setup(num_rows, dim, dtype, device, pin, backend)
        self._alloc(pin)
        self._closed = False

    def _setup(self, num_rows: Any, dim: Any, dtype: Any, device: DeviceLike,
               pin: Optional[bool], backend: Any) -> bool:
        """Validate the arguments and set the metadata; returns the resolved ``pin``."""
        self.num_rows = _as_count("num_rows", num_rows)
        self.dim = _as_count("dim", dim)
        self.dtype = _as_dtype(dtype)
        cuda = _cuda.cuda_available()
        self.device = _resolve_device(device, cuda)
        if pin is None:
            pin = cuda
        if pin and not cuda:
            raise BackendUnavailableError("pin=True needs CUDA, which is not available here")
        if not isinstance(backend, str) or backend not in BACKENDS:
            raise StpipeValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        self._mover = None
        if self.device.type == "cuda":
            name = "torch" if (backend == "auto" and not pin) else backend
            self._mover = get_backend(name)
            if self._mover.needs_pinned and not pin:
                raise StpipeValueError(
                    f"backend {backend!r} reads host memory over UVA and needs pin=True, "
                    "got pin=False; use backend='torch' for unpinned tables"
                )
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.nbytes = self.num_rows * self.dim * self.itemsize
        self._lock = threading.Lock()
        # (event, stream handle) of the last GPU write, and the last GPU read per stream
        self._write_event: Optional[Tuple["torch.cuda.Event", int]] = None
        self._read_events: Dict[int, "torch.cuda.Event"] = {}
        self._owner: Any = None
        return bool(pin)

    # -- storage ---------------------------------------------------------------------
    def _alloc(self, pin: bool, wrap: Optional[torch.Tensor] = None, owner: Any = None) -> None:
        """Allocate (or wrap ``wrap``'s memory) and page-lock when ``pin``."""
        page = _cuda.PAGE
        if wrap is None:
            span = -(-self.nbytes // page) * page  # registered bytes: whole pages
            raw = torch.empty(span + page, dtype=torch.uint8)
            off = (-raw.data_ptr()) % page
            self._bytes = raw[off:off + self.nbytes]
            reg = (raw.data_ptr() + off, span)
        else:
            self._bytes = wrap.reshape(-1).view(torch.uint8)
            reg = (wrap.data_ptr(), self.nbytes)
            owner = owner if owner is not None else wrap
        self._data = self._bytes.view(self.dtype).view(self.num_rows, self.dim)
        self._owner = owner
        self.pinned = False
        if pin:
            if wrap is None:
                self._ranges = _cuda.host_register(*reg)
            elif not (_cuda.is_registered(*reg) or wrap.is_pinned()):
                try:
                    self._ranges = _cuda.host_register(*reg)
                except StpipeRuntimeError as exc:
                    if getattr(exc, "cuda_error", None) != _cuda.ALREADY_REGISTERED:
                        raise
                    # page-locked by its owner (another table, cudaHostRegister); the
                    # owner keeps it locked, this table registers nothing
            self.pinned = True

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise StpipeRuntimeError(
                "this HostTable is closed; create or load a new one"
            )

    def close(self) -> None:
        """Wait for pending accesses, unregister the page lock and release the memory.

        Idempotent. Views obtained from :meth:`numpy`/:meth:`tensor` keep the memory
        alive (no longer page-locked) until they are dropped.

        Raises:
            StpipeRuntimeError: ``cudaHostUnregister`` failed (the table is closed anyway).
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._sync_all()
        finally:
            ranges, self._ranges = self._ranges, []
            self._data = self._bytes = self._owner = None  # type: ignore[assignment]
            self.pinned = False
            _cuda.host_unregister(ranges)

    def __enter__(self) -> "HostTable":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused: a table is not pickled, copied or ``torch.save``-d with a model.

        It can be tens of GB of page-locked memory, ordered by events of its device;
        a pickled or deep copy would silently double it (or lose it), a shallow one
        would share it and free it twice. Files and copies are explicit.

        Raises:
            StpipeTypeError: always, naming what to use instead.
        """
        raise StpipeTypeError(
            f"a HostTable ({self.num_rows} x {self.dim} {self.dtype}) cannot be pickled, "
            "copied (copy.copy, copy.deepcopy) or saved with torch.save (e.g. "
            "copy.deepcopy(model) or torch.save(model) of a model holding a "
            "HostEmbedding); save the table with "
            "table.save(path) or a checkpoint (emb.save_checkpoint / stpipe.checkpoint.save) "
            "and the rest with model.state_dict(), or copy rows with "
            "HostTable.from_numpy(table.numpy())"
        )

    def __deepcopy__(self, memo: Any) -> Any:
        return self.__reduce_ex__(4)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("pinned" if self.pinned else "unpinned")
        return (
            f"HostTable(num_rows={self.num_rows}, dim={self.dim}, dtype={self.dtype}, "
            f"device={self.device}, backend={self.backend!r}, {state})"
        )

    # -- ordering --------------------------------------------------------------------
    def synchronize(self) -> None:
        """Block until every GPU access to the table issued so far has finished.

        Raises:
            StpipeRuntimeError: the table is closed.
        """
        self._check_open()
        self._sync_all()

    def _sync_all(self) -> None:
        with self._lock:
            events = ([self._write_event[0]] if self._write_event else []) + list(self._read_events.values())
            self._write_event, self._read_events = None, {}
        for ev in events:
            ev.synchronize()

    def _resolve(self, op: str, batch: IndexBatch, buf: torch.Tensor,
                 stream: "torch.cuda.Stream"):
        """The concrete backend for this call (``auto`` measures once per size class)."""
        resolve = getattr(self._mover, "resolve", None)
        if resolve is None:
            return self._mover
        return resolve(op, self._data, batch, buf, stream, self._sync_all, pinned=self.pinned)

    def _before(self, mover: Any, stream: "torch.cuda.Stream", write: bool) -> None:
        """Order this access after earlier conflicting ones (see module docstring).

        An earlier GPU access on ``stream`` itself is already ordered by the stream, so
        only accesses on other streams are waited on (GPU movers) or synchronised (CPU
        movers wait on all of them, since their reads and writes are host-side).
        """
        handle = stream.cuda_stream
        if not mover.uses_cpu:
            # the usual case, decided without the lock: every conflicting access recorded
            # is on this stream (or none is), so the stream orders it already
            we, reads = self._write_event, self._read_events
            if (we is None or we[1] == handle) and (not write or not reads or (len(reads) == 1 and handle in reads)):
                return
        with self._lock:
            events = [self._write_event] if self._write_event else []
            if write and self._read_events:
                events += [(ev, h) for h, ev in self._read_events.items()]
        for ev, h in events:
            if mover.uses_cpu:
                ev.synchronize()
            elif mover.needs_pinned and h != handle:
                stream.wait_event(ev)

    def _after(self, mover: Any, stream: "torch.cuda.Stream", write: bool,
               ev: Optional["torch.cuda.Event"] = None) -> None:
        """Record the access's event (``ev``: one already recorded on ``stream``)."""
        if not mover.needs_pinned:
            return  # the CPU finished its host accesses before returning
        if ev is None:
            ev = torch.cuda.Event()
            ev.record(stream)
        self._mark(ev, stream.cuda_stream, write)

    def _mark(self, ev: "torch.cuda.Event", handle: int, write: bool) -> None:
        """Make ``ev`` (recorded on the stream ``handle``) this table's write event, or its
        read event on that stream."""
        with self._lock:
            if write:
                self._write_event, self._read_events = (ev, handle), {}
            else:
                self._read_events[handle] = ev  # supersedes earlier reads on this stream

    def _stream(self, stream: Optional["torch.cuda.Stream"]) -> "torch.cuda.Stream":
        if stream is None:
            return current_stream(self.device)
        if not isinstance(stream, torch.cuda.Stream):
            raise StpipeTypeError(
                f"stream must be a torch.cuda.Stream, got {type(stream).__name__}"
            )
        if stream.device != self.device:
            raise StpipeValueError(
                f"expected a stream on {self.device}, got one on {stream.device}"
            )
        return stream

    # -- views -----------------------------------------------------------------------
    def tensor(self) -> torch.Tensor:
        """The table as a ``(num_rows, dim)`` CPU tensor sharing its memory.

        Pending GPU accesses are waited for first. Do not keep writing through the view
        while gathers/scatters are in flight.
        """
        self.synchronize()
        return self._data

    def numpy(self) -> np.ndarray:
        """The table as a ``(num_rows, dim)`` numpy array sharing its memory.

        Raises:
            StpipeTypeError: a bfloat16 table (numpy has no bfloat16); use :meth:`tensor`,
                or ``tensor().view(torch.int16).numpy()`` for the raw bits.
        """
        self._check_open()
        if self.dtype == torch.bfloat16:
            raise StpipeTypeError(
                "numpy() of a bfloat16 table: numpy has no bfloat16; use tensor(), or "
                "tensor().view(torch.int16).numpy() for the raw bits"
            )
        return self.tensor().numpy()

    # -- initialisers ----------------------------------------------------------------
    def _row_chunks(self) -> List[Tuple[int, int]]:
        per = max(1, _CHUNK_BYTES // (self.dim * self.itemsize))
        return [(a, min(a + per, self.num_rows)) for a in range(0, self.num_rows, per)]

    def zeros_(self) -> "HostTable":
        """Fill with zeros (chunk-wise, no temporary). Returns self."""
        self.synchronize()
        for a, b in self._row_chunks():
            self._data[a:b].zero_()
        return self

    def uniform_(self, low: float = 0.0, high: float = 1.0,
                 generator: Optional[torch.Generator] = None) -> "HostTable":
        """Fill with U(low, high) draws, chunk-wise (deterministic for a seeded CPU
        ``generator``; no full-size temporary). Returns self."""
        self.synchronize()
        for a, b in self._row_chunks():
            self._data[a:b].uniform_(low, high, generator=generator)
        return self

    def normal_(self, mean: float = 0.0, std: float = 1.0,
                generator: Optional[torch.Generator] = None) -> "HostTable":
        """Fill with N(mean, std²) draws, chunk-wise. Returns self.

        Raises:
            StpipeValueError: ``std < 0``.
        """
        if std < 0:
            raise StpipeValueError(f"std must be >= 0, got {std}")
        self.synchronize()
        for a, b in self._row_chunks():
            self._data[a:b].normal_(mean, std, generator=generator)
        return self

    def init_(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> "HostTable":
        """Apply a ``torch.nn.init`` function (or alike) chunk-wise, as if to the whole table.

        ``fn`` first runs on a one-element stand-in of the full ``(num_rows, dim)`` shape,
        so shape-dependent constants (fan-in/fan-out of ``xavier_uniform_``,
        ``kaiming_normal_``, ...) come from the whole table; its in-place elementwise ops
        are recorded and replayed on each chunk. Shape-independent elementwise functions
        that cannot be recorded (``trunc_normal_``) are applied to each chunk directly.

        Args:
            fn: called as ``fn(tensor, *args, **kwargs)`` (e.g. ``generator=`` is passed on).

        Returns:
            self.

        Raises:
            StpipeValueError: ``fn`` is not elementwise (``orthogonal_``, ``eye_``,
                ``sparse_``, ``dirac_``); initialise a full tensor and use
                :meth:`copy_from`.
        """
        if not callable(fn):
            raise StpipeTypeError(f"fn must be callable, got {type(fn).__name__}")
        self.synchronize()
        name = getattr(fn, "__name__", repr(fn))
        try:
            calls, bad = _record_init(fn, (self.num_rows, self.dim), self.dtype, args, kwargs)
        except (ValueError, RuntimeError) as exc:  # e.g. dirac_: "only 3, 4 or 5 dimensions"
            raise StpipeValueError(
                f"init_({name}) failed on a ({self.num_rows}, {self.dim}) table: {exc}; "
                "initialise a full tensor and use copy_from()"
            ) from exc
        if bad is not None and name not in _CHUNKWISE_OK:
            raise StpipeValueError(
                f"init_({name}) is not elementwise (it ran {bad} on the table), so it "
                "cannot be applied chunk-wise; initialise a full tensor and use copy_from()"
            )
        with torch.no_grad():
            for a, b in self._row_chunks():
                chunk = self._data[a:b]
                if bad is not None:
                    fn(chunk, *args, **kwargs)
                    continue
                for op, op_args, op_kwargs in calls:
                    op(chunk, *op_args, **op_kwargs)
        return self

    def copy_from(self, src: Union[np.ndarray, torch.Tensor]) -> "HostTable":
        """Copy a ``(num_rows, dim)`` array or tensor (any float dtype, any device) in.

        Chunk-wise; values are converted to the table's dtype. Returns self.

        Raises:
            StpipeTypeError: not an array/tensor, or not floating point.
            StpipeValueError: wrong shape.
        """
        self._check_open()
        if isinstance(src, np.ndarray):
            if src.dtype.kind != "f":
                raise StpipeTypeError(f"expected a float array, got dtype {src.dtype}")
            get = lambda a, b: _from_numpy_chunk(src[a:b])  # noqa: E731
        elif isinstance(src, torch.Tensor):
            if not src.is_floating_point():
                raise StpipeTypeError(f"expected a float tensor, got dtype {src.dtype}")
            get = lambda a, b: src[a:b].detach()  # noqa: E731
        else:
            raise StpipeTypeError(
                f"expected a numpy array or torch tensor, got {type(src).__name__}"
            )
        if tuple(src.shape) != (self.num_rows, self.dim):
            raise StpipeValueError(
                f"expected shape {(self.num_rows, self.dim)}, got {tuple(src.shape)}"
            )
        self.synchronize()
        for a, b in self._row_chunks():
            self._data[a:b].copy_(get(a, b))
        return self

    @classmethod
    def from_numpy(cls, arr: np.ndarray, copy: bool = True, **kwargs: Any) -> "HostTable":
        """A table holding ``arr`` (``(num_rows, dim)`` float32 or float16).

        Args:
            arr: the rows.
            copy: copy into fresh exact-size memory (default); ``False`` wraps ``arr``'s
                memory (must be C-contiguous and writable), which is then page-locked in
                place and kept alive by the table.
            **kwargs: ``device``, ``pin``, ``backend`` as for :class:`HostTable`.

        Raises:
            StpipeTypeError: not a numpy array, or an unsupported dtype.
            StpipeValueError: not 2-d, or ``copy=False`` with non-contiguous/read-only data.
        """
        if not isinstance(arr, np.ndarray):
            raise StpipeTypeError(f"expected a numpy array, got {type(arr).__name__}")
        if arr.ndim != 2:
            raise StpipeValueError(f"expected a 2-d array (num_rows, dim), got shape {arr.shape}")
        if arr.dtype not in (np.float32, np.float16):
            raise StpipeTypeError(
                f"expected float32 or float16, got {arr.dtype}; convert with arr.astype(np.float32)"
            )
        if copy:
            return cls(arr.shape[0], arr.shape[1], arr.dtype, **kwargs).copy_from(arr)
        if not arr.flags.c_contiguous or not arr.flags.writeable:
            raise StpipeValueError(
                "copy=False needs a C-contiguous, writable array; got "
                f"c_contiguous={arr.flags.c_contiguous}, writeable={arr.flags.writeable}"
            )
        return cls._wrap(torch.from_numpy(arr), arr, kwargs)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, copy: bool = True, **kwargs: Any) -> "HostTable":
        """A table holding ``t`` (``(num_rows, dim)``, float32/float16/bfloat16).

        Args:
            t: the rows (any device when copying; CPU and contiguous for ``copy=False``).
            copy: copy into fresh memory (default) or wrap ``t``'s memory in place.
            **kwargs: ``device``, ``pin``, ``backend`` as for :class:`HostTable`.

        Raises:
            StpipeTypeError: not a tensor, or an unsupported dtype.
            StpipeValueError: not 2-d, or ``copy=False`` with a non-CPU/non-contiguous tensor.
        """
        if not isinstance(t, torch.Tensor):
            raise StpipeTypeError(f"expected a torch tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise StpipeValueError(f"expected a 2-d tensor (num_rows, dim), got shape {tuple(t.shape)}")
        _as_dtype(t.dtype)
        if copy:
            return cls(t.shape[0], t.shape[1], t.dtype, **kwargs).copy_from(t)
        if t.device.type != "cpu" or not t.is_contiguous():
            raise StpipeValueError(
                f"copy=False needs a contiguous CPU tensor, got device={t.device}, "
                f"contiguous={t.is_contiguous()}"
            )
        return cls._wrap(t.detach(), t, kwargs)

    @classmethod
    def _wrap(cls, t: torch.Tensor, owner: Any, kwargs: dict) -> "HostTable":
        unknown = set(kwargs) - {"device", "pin", "backend"}
        if unknown:
            raise StpipeTypeError(f"unexpected keyword arguments {sorted(unknown)}")
        self = cls.__new__(cls)
        self._closed, self._ranges = True, []
        pin = self._setup(t.shape[0], t.shape[1], t.dtype, kwargs.get("device"),
                          kwargs.get("pin"), kwargs.get("backend", "auto"))
        self._alloc(pin, wrap=t, owner=owner)
        self._closed = False
        return self

    # -- files -----------------------------------------------------------------------
    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the table to ``path`` as a ``.npy`` file, atomically.

        Streams the rows in chunks into ``<path>.tmp-XXXX`` in the same directory, fsyncs
        it and renames it over ``path``: a crash leaves the old file or the new one.
        float32 → ``<f4``, float16 → ``<f2``; bfloat16 has no numpy dtype and is stored
        as its raw bits, ``<u2`` (``load`` reads ``<u2`` files back as bfloat16).

        Raises:
            StpipeRuntimeError: the table is closed.
            OSError: the file cannot be written (the temporary file is removed).
        """
        self.synchronize()
        flat = self._bytes.numpy()
        header = {"descr": _NPY_DESCR[self.dtype], "fortran_order": False,
                  "shape": (self.num_rows, self.dim)}

        def write(f) -> None:
            np.lib.format.write_array_header_1_0(f, header)
            for a in range(0, self.nbytes, _CHUNK_BYTES):
                f.write(memoryview(flat[a:a + _CHUNK_BYTES]))

        atomic_write(path, write)

    @staticmethod
    def read_header(path: Union[str, os.PathLike]) -> Tuple[Tuple[int, int], torch.dtype, int]:
        """Read and validate a table file's ``.npy`` header.

        Returns:
            ``((num_rows, dim), dtype, data_offset)``.

        Raises:
            StpipeValueError: not a ``.npy`` file, a header numpy cannot parse, fortran
                order, not 2-d, or a file size that does not match the header.
            StpipeTypeError: an object/pickled array (refused: files are data, never code),
                or a dtype other than ``<f4``, ``<f2``, ``<u2`` (bfloat16 bits).
        """
        path = os.fspath(path)
        with open(path, "rb") as f:
            return _read_header(f, path)

    @classmethod
    def load(cls, path: Union[str, os.PathLike], *, dtype: Any = None,
             **kwargs: Any) -> "HostTable":
        """Load a table written by :meth:`save` (or ``np.save`` of a float32/float16 array).

        Reads the header, validates it, allocates (and page-locks) the table, then reads
        the rows straight into it in chunks (``readinto``, no temporary). Never unpickles.

        Args:
            path: the ``.npy`` file.
            dtype: optional expected dtype; a mismatch raises.
            **kwargs: ``device``, ``pin``, ``backend`` as for :class:`HostTable`.

        Returns:
            The new table.

        Raises:
            StpipeValueError, StpipeTypeError: see :meth:`read_header`; also a ``dtype``
                that differs from the file's, or a file shorter than its header says
                while reading. Nothing is left allocated on failure.
            OSError: the file cannot be opened/read.
        """
        path = os.fspath(path)
        with open(path, "rb") as f:
            (n, dim), file_dtype, offset = _read_header(f, path)
            if dtype is not None and _as_dtype(dtype) != file_dtype:
                raise StpipeTypeError(
                    f"expected a {_as_dtype(dtype)} table, got {file_dtype} in {path}"
                )
            table = cls(n, dim, file_dtype, **kwargs)
            try:
                f.seek(offset)
                flat = memoryview(table._bytes.numpy())
                pos = 0
                while pos < table.nbytes:
                    got = f.readinto(flat[pos:pos + _CHUNK_BYTES])
                    if not got:
                        raise StpipeValueError(
                            f"{path} ended after {offset + pos} bytes while reading rows; "
                            "the file is truncated"
                        )
                    pos += got
            except BaseException:
                table.close()
                raise
        return table

    # -- movement --------------------------------------------------------------------
    def _ids(self, ids: Any) -> IndexBatch:
        return self._ids_known(ids)[0]

    def _ids_known(self, ids: Any) -> Tuple[IndexBatch, bool]:
        """``(batch, distinct)``: the checked ids, and True when they are known to hold
        no repeat (strictly increasing, seen in the checking pass)."""
        if isinstance(ids, IndexBatch):
            if ids.checked_rows == self.num_rows:
                return ids, False
            # the pipeline builds one per batch and table from plan.unique and shares it
            # between the table and its optimizer-state tables, so the ids are sort-checked
            # and uploaded once; the range check against this table stays (O(1) when sorted)
            if not ids.is_sorted or (len(ids) and (ids.host[0] < 0 or ids.host[-1] >= self.num_rows)):
                check_ids(ids.host, self.num_rows)  # raises with the first bad id
            return ids, False
        arr, order = scan_ids(ids, self.num_rows)  # range and sortedness in one pass
        if arr.ndim != 1:
            raise StpipeValueError(
                f"expected 1-d ids (n,), got shape {arr.shape}; pass "
                "stpipe.plan(ids, num_rows).unique for a batch of any shape"
            )
        host = arr.astype(np.int64, copy=False)
        dev = ids if isinstance(ids, torch.Tensor) and ids.device.type == "cuda" else None
        return (IndexBatch(host=host, device_ids=dev, is_sorted=order > 0, checked_rows=self.num_rows),
                order == 2)

    def _check_rows(self, name: str, t: Any, n: int) -> None:
        if not isinstance(t, torch.Tensor):
            raise StpipeTypeError(f"expected {name} to be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != self.dtype:
            raise StpipeTypeError(
                f"expected {name} of dtype {self.dtype}, got {t.dtype}; convert with .to({self.dtype})"
            )
        if tuple(t.shape) != (n, self.dim):
            raise StpipeValueError(f"expected {name} of shape {(n, self.dim)}, got {tuple(t.shape)}")
        if t.device != self.device:
            raise StpipeValueError(f"expected {name} on {self.device}, got {t.device}")

    def gather(self, ids: Any, out: Optional[torch.Tensor] = None,
               stream: Optional["torch.cuda.Stream"] = None) -> torch.Tensor:
        """Copy rows ``ids`` of the table to :attr:`device`: ``out[j] = table[ids[j]]``.

        Args:
            ids: ``(n,)`` int64/int32 row ids (numpy array, list, CPU or CUDA tensor; a CUDA
                tensor is copied to the host for validation, which syncs its stream).
            out: optional ``(n, dim)`` contiguous tensor of the table's dtype on
                :attr:`device` to write into.
            stream: the CUDA stream that does the work (default: the current stream of
                :attr:`device`); ignored for a CPU device.

        Returns:
            ``(n, dim)`` tensor on :attr:`device`, valid on ``stream``: it was allocated
            on ``stream``; to use it on another stream, make that stream wait on
            ``stream`` and call ``record_stream`` (or keep it alive until done).

        Streams: ``stream`` first waits on the event of the last scatter that wrote host
        memory from the GPU (the torch backend blocks the host on it instead, since its
        CPU threads read the table); after a UVA read the table records a read event that
        later scatters wait on.

        Raises:
            StpipeRuntimeError: the table is closed.
            StpipeIndexError: an id out of range (the first one and its position).
            StpipeTypeError: non-integer ids; ``out`` of the wrong dtype; not a stream.
            StpipeValueError: ids not 1-d; ``out`` of the wrong shape/device or not
                contiguous; a stream on another device.
        """
        self._check_open()
        batch = self._ids(ids)
        n = len(batch)
        if out is not None:
            self._check_rows("out", out, n)
            if not out.is_contiguous():
                raise StpipeValueError("expected a contiguous out tensor, got a strided one")
        if self.device.type == "cpu":
            if out is None:
                out = torch.empty((n, self.dim), dtype=self.dtype)
            torch.index_select(self._data, 0, batch.cpu(), out=out)
            return out
        s = self._stream(stream)
        if out is None:
            with torch.cuda.stream(s):
                out = torch.empty((n, self.dim), dtype=self.dtype, device=self.device)
        if n == 0:
            return out
        mover = self._resolve("gather", batch, out, s)
        self._before(mover, s, write=False)
        mover.gather(self._data, batch, out, s)
        self._after(mover, s, write=False)
        return out

    def scatter(self, ids: Any, rows: torch.Tensor,
                stream: Optional["torch.cuda.Stream"] = None,
                assume_unique: bool = False) -> None:
        """Write rows back to the table: ``table[ids[j]] = rows[j]``.

        Args:
            ids: ``(n,)`` unique row ids (as for :meth:`gather`).
            rows: ``(n, dim)`` tensor of the table's dtype on :attr:`device`.
            stream: the CUDA stream that reads ``rows`` (default: the current stream of
                :attr:`device`); the caller has made it wait for the producer of ``rows``.
            assume_unique: skip the duplicate check (ids known unique, e.g.
                ``plan.unique``). Duplicate ids with it set leave an arbitrary winner.

        Streams: ``stream`` waits on the last write event and on the read events of
        gathers since (the torch backend blocks the host on them instead). UVA backends
        run asynchronously on ``stream``: ``rows`` is kept alive with ``record_stream``,
        and a write event is recorded that later gathers wait on. The torch backend has
        written the table when it returns.

        Raises:
            StpipeRuntimeError: the table is closed.
            StpipeIndexError: an id out of range.
            StpipeTypeError: non-integer ids, ``rows`` not a tensor or of the wrong dtype.
            StpipeValueError: ids not 1-d or duplicated; ``rows`` of the wrong shape or
                device.
        """
        self._check_open()
        batch, distinct = self._ids_known(ids)
        n = len(batch)
        self._check_rows("rows", rows, n)
        if not (assume_unique or distinct):
            _check_unique(batch, self.num_rows)
        if n == 0:
            return
        if self.device.type == "cpu":
            self._data.index_copy_(0, batch.cpu(), rows.detach())
            return
        s = self._stream(stream)
        rows = rows.detach()
        if not rows.is_contiguous():
            with torch.cuda.stream(s):
                rows = rows.contiguous()
        mover = self._resolve("scatter", batch, rows, s)
        self._before(mover, s, write=True)
        if mover.needs_pinned:
            rows.record_stream(s)
        mover.scatter(self._data, batch, rows, s)
        self._after(mover, s, write=True)


    # ----------------------------------------------------------- ids already on the GPU
    def _uva_mover(self) -> Any:
        """The CuPy backend when this table can be read and written from the GPU by
        address (pinned, CUDA, backend ``auto``/``cupy``), else ``None``."""
        mover = _fused_mover([self])
        if mover is not None:
            mover._check_pinned(self.device.index, self._data.data_ptr())
        return mover

    def _gather_device(self, ids: torch.Tensor, stream: Optional["torch.cuda.Stream"] = None
                       ) -> Optional[torch.Tensor]:
        """``table[ids]`` for ``(n,)`` int64 ids *already on the device and range-checked*
        (the compat layer's GPU ids), with no host copy of the ids; ``None`` (nothing
        done) where :meth:`_uva_mover` has no kernel.

        The ids are sorted on the device first and one UVA launch reads the rows in
        address order, writing each to its place in the output (random reads of host
        memory in address order measured about 1.7x faster on the H200 host than in the
        order asked).

        Streams: as :meth:`gather`; ``stream`` must already be ordered after the ids'
        producer.
        """
        self._check_open()
        mover = self._uva_mover()
        if mover is None:
            return None
        s = self._stream(stream)
        n = int(ids.shape[0])
        with torch.cuda.stream(s):
            out = torch.empty((n, self.dim), dtype=self.dtype, device=self.device)
            if n:
                srt, perm = torch.sort(ids)
        if n == 0:
            return out
        self._before(mover, s, write=False)
        mover.carry_many(self._data.view(1, self.num_rows, self.dim), out.view(1, n, self.dim), 1,
                         srt.data_ptr(), perm.data_ptr(), n, s)
        self._after(mover, s, write=False)
        return out

    def _scatter_last(self, ids: torch.Tensor, rows: torch.Tensor,
                      stream: Optional["torch.cuda.Stream"] = None) -> bool:
        """``table[ids[j]] = rows[j]`` where a repeated id takes its *last* occurrence, for
        ``(n,)`` int64 ids *already on the device and range-checked*; False (nothing
        done) where :meth:`_uva_mover` has no kernel.

        All on the device, with no host sync and no scratch the size of the table: a
        stable sort of the ids, then for each sorted position the index of its id's last
        occurrence (a reversed running minimum), then one UVA launch where every
        occurrence writes its id's winning row (copies to one row are identical, so
        their order does not matter).

        Streams: as :meth:`scatter`; ``stream`` must already be ordered after the
        producers of ``ids`` and ``rows``.
        """
        self._check_open()
        mover = self._uva_mover()
        if mover is None:
            return False
        n = int(ids.shape[0])
        self._check_rows("rows", rows, n)
        if n == 0:
            return True
        s = self._stream(stream)
        with torch.cuda.stream(s):
            rows = rows.detach().contiguous()
            srt, perm = torch.sort(ids, stable=True)
            pos = torch.arange(n, device=self.device)
            last = torch.ones(n, dtype=torch.bool, device=self.device)
            torch.ne(srt[1:], srt[:-1], out=last[:-1])
            end = torch.where(last, pos, n).flip(0).cummin(0).values.flip(0)
            src = perm.index_select(0, end)
        self._before(mover, s, write=True)
        rows.record_stream(s)
        mover.carry_many(rows.view(1, n, self.dim), self._data.view(1, self.num_rows, self.dim), 1,
                         src.data_ptr(), srt.data_ptr(), n, s)
        self._after(mover, s, write=True)
        return True


_FUSED: Any = None  # the cupy backend once loaded, False when it cannot load


def _fused_mover(tables: "List[HostTable]") -> Any:
    """The UVA backend that can move all ``tables`` in one launch, or ``None``.

    Needs CuPy, every table pinned on one CUDA device with backend ``auto`` or ``cupy``,
    and one dtype and dim. The fused kernels never block the host (no CPU-side movers).
    """
    t0 = tables[0]
    if t0.device.type != "cuda":
        return None
    for t in tables:
        if (not t.pinned or t.backend not in ("auto", "cupy") or t.dtype != t0.dtype
                or t.dim != t0.dim or t.device != t0.device or t.num_rows != t0.num_rows):
            return None
    return _cupy_backend()


def _cupy_backend() -> Any:
    """The CuPy backend (shared), or ``None`` where CuPy cannot run (asked once)."""
    global _FUSED
    if _FUSED is None:
        try:
            _FUSED = get_backend("cupy")
        except BackendUnavailableError:
            _FUSED = False
    return _FUSED or None



def _move_many(op: str, tables: "List[HostTable]", ids: Any, planes: torch.Tensor,
               stream: Optional["torch.cuda.Stream"], pending: Optional[list] = None) -> None:
    """``op`` (gather/scatter) of ``tables`` over the planes of ``planes``.

    ``pending``: a list the fused path appends ``(mover, tables, write)`` to instead of
    recording its event, so a caller moving several groups on one stream records one
    event for all of them (:func:`_finish`); the per-table fallback records its own.
    """
    t0 = tables[0]
    for t in tables:
        t._check_open()
    batch = t0._ids(ids)
    n = len(batch)
    expect = (len(tables), n, t0.dim)
    if tuple(planes.shape) != expect or planes.dtype != t0.dtype or planes.device != t0.device:
        raise StpipeValueError(
            f"expected a {expect} {t0.dtype} tensor on {t0.device}, got "
            f"{tuple(planes.shape)} {planes.dtype} on {planes.device}"
        )
    if n == 0:
        return
    move = _prepare_move_cached(op, tables, planes)
    if move is None:  # no fused kernel for these tables or this layout: table by table
        for g, t in enumerate(tables):
            if op == "gather":
                out = planes[g]
                res = t.gather(batch, out=out if out.is_contiguous() else None, stream=stream)
                if res.data_ptr() != out.data_ptr():
                    with torch.cuda.stream(t._stream(stream)) if t.device.type == "cuda" else contextlib.nullcontext():
                        out.copy_(res)
            else:
                t.scatter(batch, planes[g], stream=stream, assume_unique=True)
        return
    s = t0._stream(stream)
    if op == "scatter":
        planes.record_stream(s)
    move(batch.on_device(planes.device, s).data_ptr(), n, s, pending)


class _PreparedMove:
    """A fused ``op`` (gather/scatter) of fixed ``tables`` over the planes of a fixed
    device buffer, launch arguments worked out once (CuPy backend's ``prepare_many``).

    ``move(ids_ptr, n, stream, pending)`` orders the access after conflicting ones on
    other streams (each table's events), launches for the ``n`` int64 ids at device
    address ``ids_ptr`` (rows ``0..n-1`` of each plane) and then records the tables'
    event, or appends its bookkeeping to ``pending`` for :func:`_finish`. The caller keeps
    the ids and the buffer alive until ``stream`` has run the launch. The pipeline keeps
    one per staging slot and table group (:func:`_prepare_move`).
    """

    __slots__ = ("tables", "write", "_mover", "_launch")

    def __init__(self, op: str, tables: "List[HostTable]", planes: torch.Tensor, mover: Any,
                 launch: Any = None) -> None:
        self.tables = list(tables)
        self.write = op == "scatter"
        self._mover = mover
        self._launch = launch if launch is not None else mover.prepare_many(op, [t._data for t in tables], planes)

    def _order(self, stream: "torch.cuda.Stream") -> None:
        """Check the tables are open and order this access after conflicting ones on
        other streams (:meth:`HostTable._before`), before the launch."""
        mover, write = self._mover, self.write
        for t in self.tables:
            t._check_open()
            t._before(mover, stream, write=write)

    def __call__(self, ids_ptr: int, n: int, stream: "torch.cuda.Stream",
                 pending: Optional[list] = None) -> None:
        mover, write = self._mover, self.write
        self._order(stream)
        self._launch(ids_ptr, n, stream)
        if pending is not None:
            pending.append((mover, self.tables, write))
        else:
            _finish([(mover, self.tables, write)], stream)


class _PreparedMovePair:
    """Two :class:`_PreparedMove` of one op in one launch (:func:`_prepare_pair`).

    ``pair(ids_a, n_a, ids_b, n_b, stream, pending)`` does what ``a(ids_a, n_a, stream,
    pending)`` and ``b(ids_b, n_b, stream, pending)`` do (each table's ordering, one
    launch, both groups' bookkeeping appended to ``pending``); same stream contract.
    """

    __slots__ = ("a", "b", "_launch")

    def __init__(self, a: _PreparedMove, b: _PreparedMove, launch: Any) -> None:
        self.a, self.b, self._launch = a, b, launch

    def __call__(self, ids_a: int, n_a: int, ids_b: int, n_b: int, stream: "torch.cuda.Stream",
                 pending: list) -> None:
        self.a._order(stream)
        self.b._order(stream)
        self._launch(ids_a, n_a, ids_b, n_b, stream)
        pending.append((self.a._mover, self.a.tables, self.a.write))
        pending.append((self.b._mover, self.b.tables, self.b.write))


def _prepare_pair(a: _PreparedMove, b: _PreparedMove) -> Optional[_PreparedMovePair]:
    """``a`` and ``b`` (two prepared moves of one op, e.g. a step's two tables) as one
    launch, or ``None`` where their backend cannot pair them (see
    ``CupyBackend.prepare_pair``)."""
    if a.write != b.write or a._mover is not b._mover:
        return None
    prepare = getattr(a._mover, "prepare_pair", None)
    launch = prepare(a._launch, b._launch) if prepare is not None else None
    return None if launch is None else _PreparedMovePair(a, b, launch)


def _prepare_move(op: str, tables: "List[HostTable]", planes: torch.Tensor) -> Optional[_PreparedMove]:
    """A :class:`_PreparedMove` of ``tables`` over ``planes`` (``(len(tables), cap, dim)``,
    rows contiguous), or ``None`` where no fused kernel can move them (see
    :func:`_fused_mover`); the caller then uses :func:`gather_many`/:func:`scatter_many`."""
    t0 = tables[0]
    if (planes.dim() != 3 or planes.shape[0] != len(tables) or planes.dtype != t0.dtype
            or planes.device != t0.device or planes.stride(2) != 1 or planes.stride(1) != t0.dim):
        return None
    mover = _fused_mover(tables)
    if mover is None:
        return None
    return _PreparedMove(op, tables, planes, mover)


#: (op, plane geometry, table ids) -> (weak references to the tables, mover, launch) of
#: the fused moves :func:`_move_many` made (:func:`_prepare_move_cached`)
_LAUNCHES: Dict[tuple, Tuple[List["weakref.ref"], Any, Any]] = {}
_LAUNCHES_MAX = 64


def _prepare_move_cached(op: str, tables: "List[HostTable]", planes: torch.Tensor) -> Optional[_PreparedMove]:
    """:func:`_prepare_move`, its launch arguments reused for the same tables and the same
    plane geometry (address, strides, plane count, row width, dtype; any row count):
    callers that allocate their planes per call, like the SpeedTorch compat layer, then
    skip ``prepare_many``'s work (about 20 us per call on the H200 host). The cache holds the tables weakly (a dropped table
    is freed) and checks their identity, so a new table at a reused id is prepared anew."""
    # not the row count: a prepared move takes any count up to the caller's capacity
    key = (op, planes.data_ptr(), planes.shape[0], planes.shape[2], tuple(planes.stride()), planes.dtype,
           planes.device, *map(id, tables))
    hit = _LAUNCHES.get(key)
    if hit is not None and len(hit[0]) == len(tables) and all(r() is t for r, t in zip(hit[0], tables)):
        return None if hit[1] is None else _PreparedMove(op, tables, planes, hit[1], hit[2])
    move = _prepare_move(op, tables, planes)
    if len(_LAUNCHES) >= _LAUNCHES_MAX:
        _LAUNCHES.clear()
    _LAUNCHES[key] = ([weakref.ref(t) for t in tables], None if move is None else move._mover,
                      None if move is None else move._launch)
    return move


def _finish(pending: list, stream: "torch.cuda.Stream",
            ev: Optional["torch.cuda.Event"] = None) -> "torch.cuda.Event":
    """Record one event on ``stream`` behind the moves in ``pending`` (see
    :func:`_move_many`) and make it each table's read or write event; returns it.

    ``ev``: an event to record again instead of a new one (the pipeline's write-back
    event). A table's event recorded again later on the same stream only stands for more
    work, so whoever waits on it still waits for the access it was recorded for.
    """
    if ev is None:
        ev = torch.cuda.Event()
    ev.record(stream)
    handle = stream.cuda_stream
    for mover, tables, write in pending:
        if mover.needs_pinned:
            for t in tables:
                t._mark(ev, handle, write)
    return ev


def gather_many(tables: "List[HostTable]", ids: Any, out: torch.Tensor,
                stream: Optional["torch.cuda.Stream"] = None, *, pending: Optional[list] = None) -> None:
    """``out[g, j] = tables[g][ids[j]]``: several tables that share ids, in one go.

    For a table and its optimizer-state tables. With CuPy and pinned tables of one dtype
    (backend ``auto`` or ``cupy``) one UVA kernel launch moves up to four tables and never
    blocks the host; otherwise each table's own :meth:`HostTable.gather` runs.

    Args:
        tables: :class:`HostTable` objects of the same shape, dtype and device.
        ids: ``(n,)`` row ids (as for :meth:`HostTable.gather`, or an
            :class:`~stpipe.kernels.IndexBatch`).
        out: ``(len(tables), n, dim)`` on the tables' device, rows contiguous; planes may
            be strided (``buf[:, :n]`` of a larger buffer).
        stream: the CUDA stream that does the work (default: the current one).

    Streams: as :meth:`HostTable.gather`, for every table; one read event recorded after
    the launch is shared by the tables. ``pending`` (internal, the pipeline's): a list
    that takes the fused launch's bookkeeping instead, for one event behind several
    calls (``host._finish``).

    Raises:
        StpipeValueError: ``out`` of the wrong shape, dtype or device; see also
            :meth:`HostTable.gather`.
    """
    _move_many("gather", list(tables), ids, out, stream, pending)


def scatter_many(tables: "List[HostTable]", ids: Any, rows: torch.Tensor,
                 stream: Optional["torch.cuda.Stream"] = None, *, pending: Optional[list] = None) -> None:
    """``tables[g][ids[j]] = rows[g, j]`` for unique ``ids`` (not checked: pass a plan's
    ``unique``); the mirror of :func:`gather_many`, with :meth:`HostTable.scatter`'s
    stream contract (``rows`` is ``record_stream``-ed on the stream, a write event shared
    by the tables is recorded)."""
    _move_many("scatter", list(tables), ids, rows, stream, pending)


def _check_unique(batch: IndexBatch, num_rows: int) -> None:
    """Raise when ``batch`` (range-checked against ``num_rows``) repeats an id, naming
    the first id seen again and its first two positions."""
    host = batch.host
    if host.shape[0] < 2:
        return
    if batch.is_sorted:
        same = host[1:] == host[:-1]
        if not same.any():
            return
        value = int(host[int(np.argmax(same))])
    else:  # an O(n) bitmap pass (the ids were range-checked against the table)
        again = first_repeat(host, num_rows)
        if again < 0:
            return
        value = int(host[again])
    pos = np.flatnonzero(host == value)[:2].tolist()
    raise StpipeValueError(
        f"expected unique ids for scatter, got id {value} twice (positions {pos[0]} and "
        f"{pos[1]}); deduplicate with stpipe.plan(ids, num_rows) and sum the rows, or pass "
        "assume_unique=True if they are unique"
    )


def _read_header(f: Any, path: str) -> Tuple[Tuple[int, int], torch.dtype, int]:
    try:
        shape, fortran, dt, offset = read_npy_header(f)
    except NpyHeaderError as exc:
        if exc.kind == "magic":
            raise StpipeValueError(f"{path} is not a .npy file: {exc}") from None
        if exc.kind == "version":
            raise StpipeValueError(f"{path}: .npy {exc}") from None
        raise StpipeValueError(f"{path}: corrupted .npy header ({exc})") from None
    if dt.hasobject:
        raise StpipeTypeError(
            f"{path} holds Python objects, which need unpickling; stpipe refuses pickled "
            "data (allow_pickle=False): save a float32/float16 array instead"
        )
    descr = dt.str if dt.names is None else None
    if descr not in _DESCR_DTYPE:
        raise StpipeTypeError(
            f"{path}: expected dtype <f4 (float32), <f2 (float16) or <u2 (bfloat16 bits), "
            f"got {dt}; convert with arr.astype('<f4') and save again"
        )
    if len(shape) != 2 or shape[0] <= 0 or shape[1] <= 0:
        raise StpipeValueError(f"{path}: expected a 2-d (num_rows, dim) array, got shape {shape}")
    if fortran and min(shape) > 1:
        raise StpipeValueError(
            f"{path}: expected C order, got fortran_order=True; save np.ascontiguousarray(arr)"
        )
    want = offset + shape[0] * shape[1] * dt.itemsize
    size = os.fstat(f.fileno()).st_size
    if size != want:
        raise StpipeValueError(
            f"{path}: file size {size} does not match its header: expected {want} bytes "
            f"({offset} header + {shape[0]}x{shape[1]}x{dt.itemsize} data); the file is "
            "truncated or corrupted"
        )
    return (int(shape[0]), int(shape[1])), _DESCR_DTYPE[descr], offset

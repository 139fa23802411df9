"""Small host-to-device uploads through a pinned ring buffer (ids, inverses, batches).

Why: ``cudaMemcpyAsync`` from *pageable* memory may synchronise with the stream before
it copies (NVIDIA, CUDA Runtime API, "API synchronization behavior": "If pageable memory
must first be staged to pinned memory, the driver may synchronize with the stream"), and
``Tensor.pin_memory()`` per array costs a caching-host-allocator round trip (tens of us,
measured on the H200 host as the largest pipeline overhead after the kernels). Every
per-batch upload in stpipe therefore goes through :func:`upload`: the arrays are packed
into one region of a per-device pinned ring and moved by *one* asynchronous H2D copy.

Streams: the copy runs on the ``stream`` given; the device buffer is allocated on that
stream (caching allocator), so a consumer on another stream must wait on ``stream`` and
``record_stream`` the returned tensors (they are views of one buffer). A ring region is
reused only after the event recorded behind its copy has completed (the host waits on it,
which in practice never blocks: a region is reused long after its tiny copy ran).
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ._cuda import driver_calls
from ._streams import current_stream, on_stream

__all__ = ["upload", "RING_BYTES"]

#: Bytes of each device's pinned ring (uploads larger than half of it get their own
#: pinned buffer).
RING_BYTES = 8 << 20
_ALIGN = 256

#: ``torch._C._nn.unflatten_dense_tensors(flat, templates)``: views of ``flat`` back to
#: back, one per template (its shape), made by one call. Each torch call of a helper
#: thread may hand the GIL to the training thread and wait to take it back, so an upload
#: makes all its views of one dtype with one (:func:`upload`, ``Pipeline._upload_lean``).
_UNFLATTEN = getattr(getattr(torch._C, "_nn", None), "unflatten_dense_tensors", None)
#: shape -> a meta tensor of that shape (a template for :data:`_UNFLATTEN`); cleared
#: when it reaches :data:`_TEMPLATES_MAX` shapes (batches of ever new shapes)
_TEMPLATES: Dict[Tuple[int, ...], torch.Tensor] = {}
_TEMPLATES_MAX = 4096


def _template(shape: Tuple[int, ...]) -> torch.Tensor:
    t = _TEMPLATES.get(shape)
    if t is None:
        if len(_TEMPLATES) >= _TEMPLATES_MAX:
            _TEMPLATES.clear()
        t = _TEMPLATES.setdefault(shape, torch.empty(shape, dtype=torch.uint8, device="meta"))
    return t


ArrayLike = Union[np.ndarray, torch.Tensor]


class _Ring:
    """A pinned byte ring with FIFO regions guarded by events."""

    def __init__(self, nbytes: int) -> None:
        self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.np = self.buf.numpy()
        self.ptr = self.buf.data_ptr()
        self.size = nbytes
        self.head = 0
        #: ``(start, end, event)``, or ``[start, end, event or None, stream]`` (:meth:`guard_later`)
        self.pending: Deque[Sequence[Any]] = deque()
        self.lock = threading.Lock()

    def _free_until(self, start: int, end: int) -> None:
        """Wait for the pending regions overlapping ``[start, end)`` (and older ones)."""
        last = -1
        for i, e in enumerate(self.pending):
            if e[0] < end and e[1] > start:
                last = i
        for _ in range(last + 1):
            _wait_region(self.pending.popleft())
        while self.pending and self.pending[0][2] is not None and self.pending[0][2].query():
            self.pending.popleft()

    def guard(self, start: int, end: int, stream: "torch.cuda.Stream") -> "torch.cuda.Event":
        """Mark ``[start, end)`` pending until an event recorded now on ``stream`` (behind
        the copy that reads the region); returns that event. Call with :attr:`lock` held."""
        ev = torch.cuda.Event()
        ev.record(stream)
        self.pending.append((start, end, ev))
        return ev

    def guard_later(self, start: int, end: int, stream: "torch.cuda.Stream") -> List[Any]:
        """Mark ``[start, end)`` pending with its event to come: the caller sets item 2
        of the returned entry to an event recorded on ``stream`` behind every read of the
        region (one it records anyway). Until then a reuse synchronises ``stream``.
        For a ring only one thread at a time allocates from (a pipeline's own)."""
        entry: List[Any] = [start, end, None, stream]
        self.pending.append(entry)
        return entry

    def alloc(self, nbytes: int) -> int:
        """Offset of a free region of ``nbytes`` (lock held by the caller)."""
        start = self.head
        if start + nbytes > self.size:
            start = 0
        self._free_until(start, start + nbytes)
        self.head = start + nbytes
        return start


def _wait_region(entry: Sequence[Any]) -> None:
    """Block until the copies out of a ring region have run."""
    ev = entry[2]
    if ev is not None:
        ev.synchronize()
    else:  # a guard that was never recorded (the issue failed before it)
        entry[3].synchronize()


_rings: Dict[int, _Ring] = {}
_rings_lock = threading.Lock()


def _ring(device: torch.device) -> _Ring:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    r = _rings.get(idx)
    if r is None:
        with _rings_lock:
            r = _rings.get(idx)
            if r is None:
                r = _Ring(RING_BYTES)
                _rings[idx] = r
    return r


def _as_numpy(a: ArrayLike) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        # one call for the usual CPU tensor (each torch call may hand the GIL over)
        try:
            h = a.numpy()
        except (RuntimeError, TypeError):  # requires grad, a conj/neg bit, ...
            h = a.detach().resolve_conj().resolve_neg().cpu().numpy()
        return h if h.flags.c_contiguous else np.ascontiguousarray(h)
    a = np.asarray(a)
    return a if a.flags.c_contiguous else a.copy(order="C")  # keeps 0-d arrays 0-d


def upload(arrays: Sequence[ArrayLike], device: torch.device,
           stream: "torch.cuda.Stream | None" = None, *, event: bool = False):
    """Copy host arrays to ``device`` with one asynchronous H2D copy; never syncs the stream.

    Args:
        arrays: numpy arrays or CPU tensors (any numeric dtype a tensor can hold).
        device: target device; for a CPU device the arrays come back as tensors sharing
            memory (``torch.from_numpy``), nothing is copied.
        stream: the CUDA stream that does the copy (default: the current stream).

        event: also return an event recorded on ``stream`` right after the copy
            (``None`` on a CPU device).

    Returns:
        One tensor per array, same dtype and shape, views of one device buffer allocated
        on ``stream`` (see the module docstring for use on other streams); with
        ``event=True`` the pair ``(tensors, event)``.
    """
    if not isinstance(device, torch.device):
        device = torch.device(device)
    hosts = [_as_numpy(a) for a in arrays]
    if device.type != "cuda":
        views = [torch.from_numpy(h) for h in hosts]
        return (views, None) if event else views
    packed = _upload_packed(hosts, device, stream)
    if packed is not None:
        return packed if event else packed[0]
    dev, offsets, ev = upload_buffer(hosts, device, stream, event=event)
    views = _views(dev, hosts, offsets)
    return (views, ev) if event else views


def _upload_packed(hosts: Sequence[np.ndarray], device: torch.device,
                   stream: "torch.cuda.Stream | None"):
    """:func:`upload`'s usual case in few calls: arrays of one dtype, none empty, that
    fit half the ring, with the compiled driver calls. The arrays go back to back (one
    dtype: each stays aligned to its item size) into a device buffer of that dtype, are
    packed into the ring and copied by one :func:`stpipe._calls.pack_htod` (one release
    of the GIL), and come back as views made by one :data:`_UNFLATTEN` call. Returns
    ``(views, event)``, the event recorded behind the copy (it guards the ring region),
    or ``None`` with nothing done (the general path then runs).

    Stream: as :func:`upload` (the buffer is allocated on ``stream``, the copy runs there).
    """
    calls = driver_calls()
    if calls is None or _UNFLATTEN is None or not hosts:
        return None
    dt = hosts[0].dtype
    offsets: List[int] = []
    nbytes = 0
    for h in hosts:
        if h.dtype != dt or h.size == 0:
            return None
        offsets.append(nbytes)
        nbytes += h.nbytes
    ring = _ring(device)
    total = -(-nbytes // _ALIGN) * _ALIGN
    if total > ring.size // 2:
        return None
    tdt = _torch_dtype(dt)
    if stream is None:
        stream = current_stream(device)
    with ring.lock:
        base = ring.alloc(total)
        with on_stream(stream):  # sets nothing when ``stream`` is already current
            dev = torch.empty(nbytes // dt.itemsize, dtype=tdt, device=device)
        try:  # packed and copied in one release of the GIL
            err = calls.pack_htod(ring.ptr + base, hosts, offsets, dev.data_ptr(), nbytes, stream.cuda_stream)
        except (ValueError, BufferError):
            return None  # not C-contiguous after all; the region stays free (no guard)
        if err != 0:  # the driver refused the copy (packed already): torch copies it
            with on_stream(stream):
                dev.copy_(ring.buf[base:base + nbytes].view(tdt), non_blocking=True)
        ev = ring.guard(base, base + total, stream)
    return list(_UNFLATTEN(dev, [_template(h.shape) for h in hosts])), ev


def upload_buffer(hosts: Sequence[np.ndarray], device: torch.device,
                  stream: "torch.cuda.Stream | None" = None, *, event: bool = False):
    """:func:`upload` without the views, for callers that want views of some arrays
    only (each costs torch calls) and device addresses for the others.

    Args:
        hosts: C-contiguous numpy arrays (see :func:`_as_numpy`).
        device: a CUDA device.

    Returns:
        ``(dev, offsets, event)``: the uint8 device buffer (allocated on ``stream``),
        each array's byte offset in it (:func:`_views` makes tensors of them) and the
        event behind the copy (``None`` unless ``event``).
    """
    offsets, total = [], 0
    for h in hosts:
        offsets.append(total)
        total += -(-h.nbytes // _ALIGN) * _ALIGN
    total = max(total, _ALIGN)
    if stream is None:
        stream = current_stream(device)
    ring = _ring(device)
    if total > ring.size // 2:  # a large upload: its own pinned buffer
        src = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        _pack(src.numpy(), 0, hosts, offsets)
        # the caching host allocator keeps `src` until the copy has run (it records an
        # event on the copy's stream), so it may be dropped on return
        dev = _copy_up(total, device, stream, lambda: src)
        ev = None
    else:
        with ring.lock:
            base = ring.alloc(total)
            calls = driver_calls()
            if calls is None or not _pack_compiled(calls, ring.ptr + base, hosts, offsets):
                _pack(ring.np, base, hosts, offsets)
            dev = _copy_up(total, device, stream, lambda: ring.buf[base:base + total],
                           raw=None if calls is None else (calls, ring.ptr + base))
            ev = ring.guard(base, base + total, stream)
    if event and ev is None:
        ev = torch.cuda.Event()
        ev.record(stream)
    return dev, offsets, (ev if event else None)


def _pack(dst: np.ndarray, base: int, hosts: Sequence[np.ndarray], offsets: Sequence[int]) -> None:
    """Copy each host array's bytes to ``dst[base + offset:]``."""
    for h, off in zip(hosts, offsets):
        if h.nbytes:
            dst[base + off:base + off + h.nbytes] = h.reshape(-1).view(np.uint8)


def _pack_compiled(calls: Any, dst: int, hosts: Sequence[np.ndarray], offsets: Sequence[int]) -> bool:
    """:func:`_pack` to the host address ``dst`` by :func:`stpipe._calls.pack` (GIL
    released for the copies); False when an array does not export a C-contiguous buffer
    (nothing is copied then)."""
    try:
        calls.pack(dst, hosts, offsets)
    except (ValueError, BufferError):
        return False
    return True


def _copy_up(nbytes: int, device: torch.device, stream: "torch.cuda.Stream",
             src: Callable[[], torch.Tensor], raw: Optional[Tuple[Any, int]] = None) -> torch.Tensor:
    """A device byte buffer of ``nbytes`` allocated on ``stream`` and filled there from
    the pinned bytes ``src()`` (called only when ``copy_`` does the copy).

    ``raw``: ``(calls, address of src)`` to copy with the driver's
    ``cuMemcpyHtoDAsync`` (:mod:`stpipe._calls`, GIL released) instead of ``copy_``, for
    memory whose reuse the caller guards with its own events (the ring); PyTorch's
    ``copy_`` also records an event for its caching host allocator. ``copy_`` is the
    fallback if the driver refuses.
    """
    with on_stream(stream):
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if raw is None or raw[0].htod(dev.data_ptr(), raw[1], nbytes, stream.cuda_stream) != 0:
            dev.copy_(src(), non_blocking=True)
    return dev


_TORCH_DTYPE: Dict[np.dtype, torch.dtype] = {}


def _torch_dtype(dt: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype (cached)."""
    t = _TORCH_DTYPE.get(dt)
    if t is None:
        t = _TORCH_DTYPE.setdefault(dt, torch.from_numpy(np.empty(0, dtype=dt)).dtype)
    return t


def _views(dev: torch.Tensor, hosts: Sequence[np.ndarray], offsets: Sequence[int]) -> List[torch.Tensor]:
    """One typed view of ``dev`` per dtype, then a slice (and a reshape unless 1-d) per
    array: few torch calls, since each may hand the GIL to another thread."""
    out = []
    typed: Dict[np.dtype, torch.Tensor] = {}
    for h, off in zip(hosts, offsets):
        whole = typed.get(h.dtype)
        if whole is None:
            dt = _torch_dtype(h.dtype)
            # offsets are multiples of _ALIGN and the buffer's length too: every view fits
            whole = typed[h.dtype] = dev.view(dt)
        isz = h.dtype.itemsize
        part = whole[off // isz:off // isz + h.size]
        out.append(part if h.ndim == 1 else part.view(h.shape))
    return out

"""The SpeedTorch 0.1.6 API, backed by stpipe (a drop-in module).

Code written for SpeedTorch switches with one line::

    import stpipe.compat.speedtorch as SpeedTorch      # was: import SpeedTorch

and keeps its class names, constructor arguments, defaults and method names:
:class:`ModelFactory`, :class:`OptimizerFactory`, :class:`PytorchModelFactory`,
:class:`PytorchOptimizerFactory`, :class:`DataGadget`, the older aliases
(``GPUPytorch*``, ``CPUPytorch*``) and the memory-mapped variants (``ModelFactoryMM``,
``OptimizerFactoryMM``, ``DataGadgetMM``: the same classes, no file on disk). SpeedTorch's
``COM`` helpers and pinned allocators are not carried over (a clear ``AttributeError``).

Where tables live:

* ``ModelFactory(..., CPUPinn=False)`` / ``OptimizerFactory(..., CPUPinn=False)`` /
  ``DataGadget(..., CPUPinn=False)`` and the ``Pytorch*`` classes with
  ``deviceType='cuda'``: a torch tensor in GPU memory (a CPU tensor where CUDA is missing).
* ``CPUPinn=True`` / ``deviceType='cpu'``: a :class:`stpipe.host.HostTable`, page-locked
  at exact size (``cudaHostRegister``; ``pinType=False`` leaves it pageable). Rows move
  through stpipe's transfer backends (``auto``: UVA kernels and/or CPU gather + DMA).

Gathered rows always go to the device of the model variable (a model on the GPU gets GPU
rows even when the table is in host memory). ``datatype``/``dtype`` accept ``'float32'``,
``'float16'`` (and ``'bfloat16'``) as well as torch dtypes.

Differences from SpeedTorch (its defects, fixed):

* **Duplicate ids** in a batch are deduplicated (:func:`stpipe.planner.plan`): each row is
  gathered once, its gradient is the sum over its occurrences (what ``nn.Embedding``
  gives) and it is written back once. The model variable's weight then holds the ``k``
  unique rows (ascending id order) and a forward pre-hook on the embedding module remaps
  the dummy positions ``0..n-1`` of :meth:`ModelFactory.variableTransformer` onto them,
  so user code is unchanged (one hook per module: a newer switcher of the module takes
  it over, and it holds its switcher weakly, so a dropped switcher is freed). Batches
  without duplicates keep SpeedTorch's layout exactly (weight row ``j`` holds the
  ``j``-th id) and no remapping happens. The remapping needs
  the dummy positions to go *through the module's forward* (``module(dummy)``); code that
  indexes ``module.weight`` by hand should pass ``dedup=False`` (SpeedTorch's layout: one
  weight row per position; duplicates are then written back once, the last occurrence
  winning, instead of at random).
* **Ids are checked**: an id outside ``[0, total_classes)`` (or ``[0, rows)`` of a
  :class:`DataGadget`) raises :class:`IndexError` (:class:`stpipe.StpipeIndexError`)
  naming the first bad id and its position, before any row moves. (SpeedTorch's CuPy
  tables wrapped such ids around onto another row.) Float ids raise :class:`TypeError`.
* **No device-wide synchronisation per swap**: gathers and scatters run on the current
  CUDA stream of the model's device; host tables order their own accesses with events.
* **Fewer launches per swap** (pinned tables, CuPy present): a model switcher's
  ``beforeForwardPass`` gathers the weight rows and the rows of its
  :class:`OptimizerFactory`'s state tables in one UVA launch, and the optimizer
  switcher's ``beforeForwardPass`` installs them. In ``afterOptimizerStep`` the model
  switcher leaves its write-back to the optimizer switcher's ``afterOptimizerStep``, which
  writes weight and state rows in one launch. Nothing can tell: any call that reads or
  writes the model switcher's table first (``getNumpyVersion``, a save, the next
  ``beforeForwardPass``, the other call order) writes the weight rows then. (They are
  the rows the weight holds at that moment: a change made to the weight in place between
  the two calls would be written too.)
* **A step's ids are planned once per table**: the first switcher call of a step
  compares its ids with the last step's; the step's later calls take its layout when
  given the same id objects still holding its ids (tensors: their version counter;
  numpy arrays: one ``memcmp`` of their content, as numpy keeps no edit counter), so
  buffers refilled in place are seen, between steps or between any two calls. (A tensor
  written through a numpy view of it bypasses its version counter and is not seen
  between two calls of one step.)
* **No global allocator swapping**: pinned tables are page-locked in place at exact size.
* **Optimizer switchers run on PyTorch 2.x** (SpeedTorch's step state was a Python int):
  SparseAdam, Adagrad, Adadelta, Adamax, Adam, AdamW, ASGD, RMSprop, Rprop, and also SGD,
  NAdam and RAdam. Per-row state tensors (shaped like the weight) live in tables of their
  own, swapped in and out by the ids; scalar state (``step``, ASGD's ``eta``/``mu``,
  NAdam's ``mu_product``) stays per parameter in ``optimizer.state``. Rows never seen
  start from the optimizer's initial values (Adagrad: ``initial_accumulator_value``;
  Rprop: ``prev = 0``, ``step_size = lr``; zeros elsewhere).
* **CuPy is optional**: where it is missing, the CuPy-named classes (``ModelFactory``,
  ``OptimizerFactory``, ``DataGadget``) use the torch backend and say so once
  (:class:`CupyFallbackWarning`). Results are the same either way.
* :meth:`DataGadget.getData` returns rows on the current CUDA device, or on the CPU where
  CUDA is missing (SpeedTorch required CUDA).
* ``saveTorch`` writes a CPU tensor (loadable anywhere, ``torch.load(...,
  weights_only=True)``); ``getNumpyVersion`` always returns a numpy copy (SpeedTorch's
  ``CPUPytorch*`` classes returned the tensor); files are written atomically.

Not provided: the ``COM`` co-occurrence helpers and SpeedTorch's pinned allocators
(``PMemory``, ``my_pinned_allocator`` and their ``MM`` twins); asking for them raises an
``AttributeError`` that says what to use instead.
"""
from __future__ import annotations

import importlib.util
import os
import pickle
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .. import _cuda
from .._io import atomic_write, read_npy_header
from .._errors import (
    BackendUnavailableError,
    StpipeIndexError,
    StpipeRuntimeError,
    StpipeTypeError,
    StpipeValueError,
)
from .._streams import current_stream
from ..kernels import IndexBatch
from ..embedding import _version
from ..host import _from_numpy_chunk  # numpy chunks as torch takes them, as HostTable.copy_from
from ..pipeline import _other_empty
from ..planner import _check_tensor_dtype, as_index_array, check_ids, first_repeat, plan, same_ids, scan_ids

__all__ = [
    "ModelFactory",
    "OptimizerFactory",
    "PytorchModelFactory",
    "PytorchOptimizerFactory",
    "DataGadget",
    "GPUPytorchModelFactory",
    "GPUPytorchOptimizerFactory",
    "CPUPytorchModelFactory",
    "CPUPytorchOptimizerFactory",
    "ModelFactoryMM",
    "OptimizerFactoryMM",
    "DataGadgetMM",
    "CupyFallbackWarning",
    "SUPPORTED_OPTIMIZERS",
]

PathLike = Union[str, "os.PathLike[str]"]


# ---------------------------------------------------------------------------------------
# warnings, dtypes, placement
# ---------------------------------------------------------------------------------------
class CupyFallbackWarning(UserWarning):
    """A CuPy-named class runs on the torch backend because CuPy is not installed."""


_warned: set = set()
_warn_lock = threading.Lock()


def _warn_once(key: str, message: str, category: type = UserWarning) -> None:
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, category, stacklevel=4)


def _cupy_installed() -> bool:
    """True when ``import cupy`` can be attempted (does not import it)."""
    try:
        return importlib.util.find_spec("cupy") is not None
    except (ImportError, ValueError):  # pragma: no cover - broken installs
        return False


_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "double": torch.float64,
}
#: dtypes a HostTable holds; other dtypes use a plain tensor.
_HOST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _as_dtype(dtype: Any, name: str = "datatype") -> torch.dtype:
    """``'float32'``/``'float16'``/..., numpy dtypes and torch dtypes → a torch float dtype."""
    if isinstance(dtype, torch.dtype):
        got = dtype
    elif isinstance(dtype, str) and dtype.lower() in _DTYPES:
        got = _DTYPES[dtype.lower()]
    else:
        try:
            got = torch.from_numpy(np.empty(0, dtype=np.dtype(dtype))).dtype
        except (TypeError, ValueError):
            raise StpipeTypeError(
                f"{name} must be 'float32', 'float16' or a torch dtype, got {dtype!r}"
            ) from None
    if not got.is_floating_point:
        raise StpipeTypeError(f"{name} must be a floating-point dtype, got {got}")
    return got


def _cuda_device(device: Any = None) -> torch.device:
    """A CUDA device with its index (``'cuda'`` → ``cuda:<current>``)."""
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class _Placement:
    """Where a switcher keeps its table(s).

    Attributes:
        where: ``"device"`` (one torch tensor on ``table_device``) or ``"host"`` (a
            HostTable, or a CPU tensor for dtypes HostTable does not hold).
        table_device: the device of a ``"device"`` table.
        pin: page-lock a host table.
        backend: the HostTable backend name.
    """

    def __init__(self, where: str, table_device: torch.device, pin: bool, backend: str):
        self.where, self.table_device, self.pin, self.backend = where, table_device, pin, backend

    def __repr__(self) -> str:
        return (f"_Placement({self.where!r}, table_device={self.table_device}, "
                f"pin={self.pin}, backend={self.backend!r})")


def _placement(*, on_gpu: bool, pin: bool, cupy_named: bool, what: str,
               gpu_device: Any = None) -> _Placement:
    """Resolve SpeedTorch's placement flags on this machine.

    Args:
        on_gpu: SpeedTorch kept the table in GPU memory.
        pin: SpeedTorch page-locked the host table.
        cupy_named: the class was CuPy-backed in SpeedTorch (warn once when CuPy is
            missing; its host tables then use the torch backend).
        what: the class name, for messages.
        gpu_device: the CUDA device of a GPU table (default: current).
    """
    cuda = _cuda.cuda_available()
    backend = "auto" if cuda else "torch"
    if cupy_named and not _cupy_installed():
        _warn_once(
            "cupy",
            f"{what}: CuPy is not installed, so stpipe's SpeedTorch compat layer uses its "
            "torch backend for the CuPy-named classes (ModelFactory, OptimizerFactory, "
            "DataGadget); results are the same. Install cupy-cuda12x / cupy-cuda13x for "
            "the CuPy kernels.",
            CupyFallbackWarning,
        )
        backend = "torch"
    if on_gpu:
        if cuda:
            return _Placement("device", _cuda_device(gpu_device), False, backend)
        if not cupy_named:
            _warn_once(
                "nocuda",
                f"{what}: deviceType='cuda' but CUDA is not available; the table is kept "
                "in CPU memory instead.",
            )
        return _Placement("device", torch.device("cpu"), False, backend)
    return _Placement("host", torch.device("cpu"), bool(pin and cuda), backend)


# ---------------------------------------------------------------------------------------
# stores: one (num_rows, dim) table, in a torch tensor or a HostTable
# ---------------------------------------------------------------------------------------
def _ids_tensor(ids: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host ids as an int64 tensor on ``device`` (an H2D copy on the current stream)."""
    arr = np.ascontiguousarray(ids, dtype=np.int64)
    if device.type == "cuda":
        # through stpipe's pinned upload ring: a copy from pageable memory may sync the stream
        from .._staging import upload

        return upload([arr], device, current_stream(device))[0]
    return torch.from_numpy(arr)


class _TensorStore:
    """A table held in one torch tensor (GPU memory, or a CPU tensor).

    All work runs on the current stream of the tensor's device; nothing synchronises
    except reading the whole table back (:meth:`numpy`, :meth:`cpu_tensor`).
    """

    #: gathering sorted ids is no faster than gathering them in the order asked for
    sorted_helps = False

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self._stamps: Optional[torch.Tensor] = None  # see scatter_last
        self._bad: Optional[torch.Tensor] = None
        self._calls = 0

    @classmethod
    def empty(cls, n: int, dim: int, dtype: torch.dtype, device: torch.device,
              pin: bool = False) -> "_TensorStore":
        if device.type == "cpu":
            return cls(torch.empty((n, dim), dtype=dtype, pin_memory=pin))
        return cls(torch.empty((n, dim), dtype=dtype, device=device))

    num_rows = property(lambda self: int(self.t.shape[0]))
    dim = property(lambda self: int(self.t.shape[1]))
    dtype = property(lambda self: self.t.dtype)
    device = property(lambda self: self.t.device)

    # init
    def zeros_(self) -> None:
        self.t.zero_()

    def fill_(self, value: float) -> None:
        self.t.fill_(value)

    def uniform_(self, low: float, high: float) -> None:
        self.t.uniform_(low, high)

    def normal_(self, mean: float, std: float) -> None:
        if std < 0:
            raise StpipeValueError(f"stdDev must be >= 0, got {std}")
        self.t.normal_(mean, std)

    def init_(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            with torch.no_grad():
                fn(self.t, *args)
        except ValueError as exc:  # e.g. dirac_: "only 3, 4 or 5 dimensions"
            if isinstance(exc, StpipeValueError):
                raise
            raise StpipeValueError(
                f"customInit({getattr(fn, '__name__', repr(fn))}) failed on a table of shape "
                f"{tuple(self.t.shape)}: {exc}"
            ) from exc

    def copy_from(self, src: Union[np.ndarray, torch.Tensor]) -> None:
        _copy_chunked(self.t, src)

    # movement
    def gather(self, ids: np.ndarray, device: torch.device,
               ids_dev: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``table[ids]`` on ``device``; ``ids_dev``: the same ids already on the table's
        device (saves an upload)."""
        idx = ids_dev if ids_dev is not None else _ids_tensor(ids, self.t.device)
        return _to_device(self.t.index_select(0, idx), device)

    def scatter(self, ids: np.ndarray, rows: torch.Tensor,
                ids_dev: Optional[torch.Tensor] = None) -> None:
        rows = rows.detach().to(device=self.t.device, dtype=self.t.dtype)
        idx = ids_dev if ids_dev is not None else _ids_tensor(ids, self.t.device)
        self.t.index_copy_(0, idx, rows)

    def stamps_fit(self) -> bool:
        """Whether :meth:`scatter_last`'s scratch (8 bytes per row) is at most a quarter
        of the table's bytes (rows of 32 bytes or more)."""
        return self.t.shape[1] * self.t.element_size() >= 32

    def checks_in_kernel(self) -> bool:
        """Whether :meth:`scatter_last` range-checks ids itself (the CuPy kernels on a
        GPU table), so callers may pass unchecked device ids."""
        return self.t.device.type == "cuda" and self.t.is_contiguous() and _last_wins() is not None

    def scatter_last(self, idx: torch.Tensor, rows: torch.Tensor, checked: bool = True) -> None:
        """``table[idx[j]] = rows[j]`` where a repeated id takes its *last* occurrence;
        ``idx`` is a ``(n,)`` int64 tensor on the table's device, range-checked unless
        ``checked`` is False (then only where :meth:`checks_in_kernel`).

        No sort. Each named row's stamp (a per-table int64 scratch, made once) takes the
        largest ``call << 32 | j`` that names it; the call number makes older stamps
        smaller, so the scratch is never reset. Then only each id's winning occurrence
        writes. With CuPy that is two kernels (:meth:`CupyBackend.scatter_last`: an
        ``atomicMax`` pass, then a masked row copy), and no host sync unless ``checked``
        is False: then one flag is read back (a wait on the current stream) and an id
        out of range raises with the table unchanged. Without CuPy the twin is torch ops
        (``scatter_reduce_`` amax, then every occurrence copies its id's winning row; the
        copies to one row are identical, so their order does not matter). Stream: the
        current one.

        Raises:
            IndexError: (``checked=False``) an id out of range; nothing was written.
        """
        rows = rows.detach().to(device=self.t.device, dtype=self.t.dtype)
        n = int(idx.shape[0])
        if n == 0:
            return
        if self._stamps is None:
            self._stamps = torch.zeros((self.num_rows,), dtype=torch.int64, device=self.t.device)
        self._calls += 1
        base = self._calls << 32
        kern = _last_wins() if self.checks_in_kernel() else None
        if kern is not None:
            if self._bad is None:
                self._bad = torch.zeros((1,), dtype=torch.int64, device=self.t.device)
            idx = idx.contiguous()
            kern.scatter_last(self.t, idx, rows.contiguous(), self._stamps, self._bad, self._calls,
                              current_stream(self.t.device))
            if not checked and int(self._bad.item()) == base:
                check_ids(idx.cpu().numpy(), self.num_rows)  # raises, naming the first bad id
            return
        if not checked:
            _check_device_range(idx, self.num_rows)
        pos = torch.arange(base, base + n, dtype=torch.int64, device=self.t.device)
        self._stamps.scatter_reduce_(0, idx, pos, reduce="amax")
        win = self._stamps.index_select(0, idx).sub_(base)
        self.t.index_copy_(0, idx, rows.index_select(0, win))

    # whole table
    def cpu_tensor(self) -> torch.Tensor:
        """A CPU copy of the table."""
        return self.t.detach().to("cpu", copy=True)

    def numpy(self) -> np.ndarray:
        return self.cpu_tensor().numpy()

    def chunks(self, rows_per_chunk: int):
        for a in range(0, self.num_rows, rows_per_chunk):
            yield self.t[a:a + rows_per_chunk].cpu().numpy()

    def close(self) -> None:
        self.t = None  # type: ignore[assignment]


class _HostStore:
    """A table in a :class:`stpipe.host.HostTable` (pinned host memory).

    Gathers and scatters run on the current stream of the table's device; the table
    orders its own accesses with events (no device-wide sync).
    """

    def __init__(self, table: Any) -> None:
        self.table = table
        self.sorted_helps = table.device.type == "cuda"
        #: bumped by every write through this store (rows gathered ahead of use by a
        #: fused gather are valid while it is unchanged; see :class:`_Stash`)
        self.version = 0

    def takes_device_ids(self, device: torch.device) -> bool:
        """Whether ids on ``device`` can reach the table's UVA kernels as they are (a
        pinned table of that device with CuPy), with no host copy."""
        return self.table.device == device and self.table._uva_mover() is not None

    @classmethod
    def empty(cls, n: int, dim: int, dtype: torch.dtype, device: torch.device,
              pin: bool, backend: str) -> "_HostStore":
        return cls(_new_host_table(lambda **kw: _host_table_cls()(n, dim, dtype, **kw),
                                   device, pin, backend))

    num_rows = property(lambda self: self.table.num_rows)
    dim = property(lambda self: self.table.dim)
    dtype = property(lambda self: self.table.dtype)
    device = property(lambda self: self.table.device)

    def zeros_(self) -> None:
        self.table.zeros_()
        self.version += 1

    def fill_(self, value: float) -> None:
        self.table.init_(torch.nn.init.constant_, float(value))
        self.version += 1

    def uniform_(self, low: float, high: float) -> None:
        self.table.uniform_(low, high)
        self.version += 1

    def normal_(self, mean: float, std: float) -> None:
        self.table.normal_(mean, std)
        self.version += 1

    def init_(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(table, *args)``: chunk-wise where ``fn`` is elementwise
        (:meth:`stpipe.host.HostTable.init_`), else (``orthogonal_``, ``eye_``,
        ``sparse_``, ...) on a full float32 tensor of the table's shape in host memory,
        then copied in: a transient copy of the table (4 bytes per element) besides the
        table itself, plus whatever ``fn`` needs (a QR of the whole table for
        ``orthogonal_``), as SpeedTorch, which applied ``fn`` to its one tensor.

        Raises:
            StpipeValueError: ``fn`` fails on a full tensor too (the chunk-wise
                error, which names it); the table is then unchanged.
        """
        try:
            self.table.init_(fn, *args)
        except StpipeValueError as exc:  # not elementwise: raised before anything is written
            work = self.dtype if self.dtype in (torch.float32, torch.float64) else torch.float32
            full = torch.empty((self.num_rows, self.dim), dtype=work)
            try:
                with torch.no_grad():
                    fn(full, *args)
            except Exception:
                raise exc from None
            self.table.copy_from(full)
            del full
        self.version += 1

    def copy_from(self, src: Union[np.ndarray, torch.Tensor]) -> None:
        if isinstance(src, np.ndarray) and src.dtype.kind != "f":
            src = src.astype(np.float32)
        self.table.copy_from(src)
        self.version += 1

    def _stream(self) -> Optional["torch.cuda.Stream"]:
        dev = self.table.device
        return current_stream(dev) if dev.type == "cuda" else None

    def gather(self, ids: np.ndarray, device: torch.device,
               ids_dev: Optional[torch.Tensor] = None) -> torch.Tensor:
        # host ids: the table validates them on the host without a device round trip
        rows = self.table.gather(ids, stream=self._stream())
        return _to_device(rows, device)

    def scatter(self, ids: np.ndarray, rows: torch.Tensor,
                ids_dev: Optional[torch.Tensor] = None) -> None:
        rows = rows.detach()
        if rows.device != self.table.device or rows.dtype != self.table.dtype:
            rows = rows.to(device=self.table.device, dtype=self.table.dtype)
        self.table.scatter(ids, rows, stream=self._stream(), assume_unique=True)
        self.version += 1

    def cpu_tensor(self) -> torch.Tensor:
        return self.table.tensor().clone()

    def numpy(self) -> np.ndarray:
        return self.table.numpy().copy()

    def chunks(self, rows_per_chunk: int):
        t = self.table.tensor()
        for a in range(0, self.num_rows, rows_per_chunk):
            yield t[a:a + rows_per_chunk].numpy()

    def close(self) -> None:
        self.table.close()


def _host_table_cls():
    from ..host import HostTable  # imported lazily: compat sits on top of the core

    return HostTable


def _new_host_table(make: Callable[..., Any], device: torch.device, pin: bool,
                    backend: str) -> Any:
    """Build a HostTable; a backend that cannot load here falls back to ``torch``."""
    try:
        return make(device=device, pin=pin, backend=backend)
    except (BackendUnavailableError, ImportError) as exc:
        if backend == "torch":
            raise
        _warn_once(
            "backend-" + backend,
            f"stpipe backend {backend!r} is unavailable here ({exc}); using 'torch'.",
        )
        return make(device=device, pin=pin, backend="torch")


def _to_device(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    if rows.device == device:
        return rows
    # H2D may be asynchronous (pinned or device source); D2H must be blocking because
    # the destination is pageable memory the caller reads right away.
    return rows.to(device, non_blocking=device.type == "cuda")


def _copy_chunked(dst: torch.Tensor, src: Union[np.ndarray, torch.Tensor],
                  chunk_bytes: int = 64 << 20) -> None:
    """``dst.copy_(src)`` in row chunks (``src`` may be a memory-mapped array)."""
    if tuple(src.shape) != tuple(dst.shape):
        raise StpipeValueError(f"expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    row = max(1, int(np.prod(dst.shape[1:], dtype=np.int64)) * dst.element_size())
    per = max(1, chunk_bytes // row)
    with torch.no_grad():
        for a in range(0, int(dst.shape[0]), per):
            part = src[a:a + per]
            if isinstance(part, np.ndarray):
                part = _from_numpy_chunk(part)
            dst[a:a + per].copy_(part)


def _new_store(n: int, dim: int, dtype: torch.dtype, where: _Placement,
               device: torch.device) -> Union[_TensorStore, _HostStore]:
    """An uninitialised ``(n, dim)`` table placed per ``where``; host tables send
    gathered rows to ``device``."""
    if where.where == "device":
        return _TensorStore.empty(n, dim, dtype, where.table_device)
    if dtype in _HOST_DTYPES:
        return _HostStore.empty(n, dim, dtype, device, where.pin, where.backend)
    return _TensorStore.empty(n, dim, dtype, torch.device("cpu"), pin=where.pin)


# ---------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------
def _npy_name(name: PathLike) -> str:
    """``np.save``'s (and so ``cupy.save``'s) naming rule: append ``.npy`` if missing."""
    path = os.fspath(name)
    return path if path.endswith(".npy") else path + ".npy"


def _atomic_write(path: str, write: Callable[[Any], None]) -> None:
    """Write through ``write(file)`` into a temporary file, then rename it over ``path``."""
    atomic_write(path, write)


def _save_store_npy(store: Union[_TensorStore, _HostStore], path: str,
                    shape: Tuple[int, ...]) -> None:
    """Save a store as a ``.npy`` file of ``shape`` (its rows reshaped), atomically."""
    if isinstance(store, _HostStore) and len(shape) == 2:
        store.table.save(path)
        return
    if store.dtype == torch.bfloat16:
        raise StpipeTypeError("a bfloat16 table without a HostTable cannot be saved as .npy")
    np_dtype = torch.empty(0, dtype=store.dtype).numpy().dtype

    def write(f: Any) -> None:
        np.lib.format.write_array_header_1_0(
            f, {"descr": np.lib.format.dtype_to_descr(np_dtype), "fortran_order": False,
                "shape": tuple(int(s) for s in shape)})
        per = max(1, (64 << 20) // max(1, store.dim * np_dtype.itemsize))
        for part in store.chunks(per):
            f.write(memoryview(np.ascontiguousarray(part)).cast("B"))

    _atomic_write(path, write)


def _open_npy(path: PathLike) -> np.ndarray:
    """Memory-map a ``.npy`` file (never unpickles).

    Raises:
        StpipeValueError: a file that needs unpickling (pickled or object data), or a
            damaged ``.npy`` file (a header that does not parse, or less data than the
            header describes).
    """
    path = os.fspath(path)
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError) as exc:
        msg = str(exc)
        if "pickle" in msg or "Python objects" in msg:
            raise StpipeValueError(
                f"{path}: expected a .npy array of numbers, got a file that needs unpickling "
                f"({msg}); stpipe refuses pickled data"
            ) from None
        raise StpipeValueError(f"{path}: expected a whole .npy array, got {_npy_damage(path, exc)}") from None


def _npy_damage(path: str, exc: BaseException) -> str:
    """What is wrong with a ``.npy`` file that ``np.load`` could not map (for a message)."""
    try:
        with open(path, "rb") as f:
            shape, _, dtype, offset = read_npy_header(f)
        need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        have = os.path.getsize(path) - offset
    except Exception as why:  # a header that does not parse
        return f"a file whose .npy header cannot be read ({str(why) or str(exc)})"
    return (f"{have} bytes of data after a header that describes {need} ({tuple(shape)} "
            f"{dtype}): the file is truncated or damaged")


def _load_store(path: PathLike, where: _Placement, device: torch.device,
                expect: Optional[Tuple[int, int]] = None,
                dtype: Optional[torch.dtype] = None) -> Tuple[Union[_TensorStore, _HostStore], Tuple[int, ...]]:
    """Load a ``.npy`` file into a new store placed per ``where``.

    Args:
        expect: the ``(num_rows, dim)`` the file must have (switchers), or None (any
            shape: a DataGadget; rows of more than one dimension are flattened).
        dtype: convert to this dtype (switchers); None keeps the file's.

    Returns:
        ``(store, file_shape)``.
    """
    arr = _open_npy(path)
    if arr.ndim == 0:
        raise StpipeValueError(f"{os.fspath(path)}: expected an array of rows, got a scalar")
    shape = tuple(int(s) for s in arr.shape)
    if expect is not None and shape != tuple(expect):
        raise StpipeValueError(
            f"{os.fspath(path)} holds a table of shape {shape}, expected {tuple(expect)} "
            "(total_classes, embed_dimension)"
        )
    flat = arr.reshape(shape[0], -1) if arr.ndim != 2 else arr
    try:  # (a big-endian file is read in native byte order, a longdouble one as float64)
        file_dtype = _from_numpy_chunk(np.empty(0, dtype=arr.dtype)).dtype
    except (TypeError, ValueError):
        raise StpipeTypeError(
            f"{os.fspath(path)}: expected a float (or integer) .npy array, got dtype {arr.dtype}"
        ) from None
    want = dtype or file_dtype
    n, dim = int(flat.shape[0]), int(flat.shape[1])
    if (where.where == "host" and want in _HOST_DTYPES and want == file_dtype
            and arr.ndim == 2 and arr.dtype.str in ("<f4", "<f2")):
        del arr, flat  # HostTable.load reads the file straight into the table
        table = _new_host_table(
            lambda **kw: _host_table_cls().load(path, **kw), device, where.pin, where.backend)
        return _HostStore(table), shape
    if where.where == "host" and want in _HOST_DTYPES:
        store = _HostStore.empty(n, dim, want, device, where.pin, where.backend)
        store.copy_from(flat)  # chunk-wise, converted to the table's dtype
        return store, shape
    table_device = where.table_device if where.where == "device" else torch.device("cpu")
    t = _TensorStore.empty(n, dim, want, table_device,
                           pin=where.pin and where.where == "host").t
    _copy_chunked(t, flat)
    return _TensorStore(t), shape


# ---------------------------------------------------------------------------------------
# ids → the rows a step moves
# ---------------------------------------------------------------------------------------
def _flat_ids(pos: Any, neg: Any) -> np.ndarray:
    """SpeedTorch's reshaped retrieval: ``concat(pos.ravel(), neg.ravel())``; integer ids
    only (:func:`stpipe.planner.as_index_array`; the range is checked by the caller)."""
    a = as_index_array(pos).reshape(-1)
    if neg is None:
        return a
    b = as_index_array(neg).reshape(-1)
    return np.concatenate([a, b]) if a.dtype == b.dtype else np.concatenate(
        [a.astype(np.int64), b.astype(np.int64)])


#: rows a fused gather's planes are rounded up to (:meth:`_Layout.gather_planes`)
_CAP_ROUND = 1024


class _Layout:
    """How one batch's ids map onto the rows a model variable holds.

    ``compact`` (deduplicated): the weight holds the ``k`` unique ids ascending and the
    embedding's pre-hook maps position ``i`` to row ``inverse[i]``. Otherwise the weight
    holds one row per position (SpeedTorch's layout) and write-back keeps, for each unique
    id, the row of its last occurrence.
    """

    def __init__(self, flat: np.ndarray, num_rows: int, dedup: bool, copy: bool = True) -> None:
        # a copy: the caller's id buffer may be refilled in place for the next batch
        # (``copy=False``: ``flat`` is already a fresh array)
        self.ids = np.array(flat, copy=True) if copy else flat
        self.num_rows = int(num_rows)
        self.dedup = bool(dedup)
        self.plan = plan(self.ids, num_rows)
        self.unique = self.plan.unique
        self.inverse = self.plan.inverse.reshape(-1)
        self.n = int(self.ids.shape[0])
        self.k = self.plan.num_unique
        self.has_dups = self.k < self.n
        self.compact = self.dedup and self.has_dups
        # ids already sorted and unique: gathering `unique` gives the layout directly
        self.identity = (not self.has_dups) and bool(np.array_equal(self.unique, self.ids))
        self._dev: Dict[Tuple[str, torch.device], torch.Tensor] = {}
        self._last: Optional[np.ndarray] = None
        # the unique ids as one IndexBatch shared by every host-table gather and scatter of
        # this batch (model and optimizer switchers): range-checked in O(1), uploaded once
        self._unique_batch = IndexBatch(host=self.unique, is_sorted=True)
        self._stash: Optional[weakref.ref] = None
        #: the id objects last checked against ``ids``, each with its probe (see
        #: :meth:`unchanged`), and the switcher calls made on this layout since it was
        #: made (:func:`_layout_for`)
        self.src: Tuple[Any, Any, Any, Any] = (None, None, None, None)
        self.calls: set = set()

    @property
    def stash(self) -> Optional["_Stash"]:
        """A model switcher's fused gather of its table and its optimizer's state tables
        for these ids (or None).

        Held weakly; the switcher that gathered holds it (``_ModelSwitch._stash``). The
        layout lives as long as the weight, and switchers the user dropped must not
        keep their full tables alive through it.
        """
        ref = self._stash
        return ref() if ref is not None else None

    @stash.setter
    def stash(self, stash: Optional["_Stash"]) -> None:
        self._stash = weakref.ref(stash) if stash is not None else None

    def checked(self, pos: Any, neg: Any, call: Optional[str]) -> None:
        """Note that ``pos``/``neg`` were found to hold this layout's ids, by ``call``.

        Keeps a probe per part for :meth:`unchanged`: a tensor's version counter, or for
        a numpy array a view of ``ids`` shaped like it (made here, once per check, so the
        later calls of a step compare without allocating); ``None`` for ids of other
        kinds (lists, ...), which are always compared in full.
        """
        pp = _probe(pos, self.ids, 0)
        npb = None
        if neg is not None and pp is not None:
            npb = _probe(neg, self.ids, self.n - _numel(neg))
            if npb is None:
                pp = None
        self.src = (pos, neg, pp, npb)
        if call is not None:
            self.calls.add(call)

    def unchanged(self, pos: Any, neg: Any) -> bool:
        """Whether ``pos``/``neg`` are the id objects last checked and still hold this
        layout's ids: a tensor by its version counter (no read), a numpy array by its
        content (one ``memcmp`` against a view of ``ids``: numpy has no version counter,
        so a buffer refilled in place is only seen by reading it). Allocates nothing
        beyond what :func:`stpipe.planner.same_ids` does."""
        src = self.src
        if pos is not src[0] or neg is not src[1]:
            return False
        pp = src[2]
        if pp is None:
            return False
        if (pos._version != pp) if isinstance(pp, int) else not same_ids(pos, pp):
            return False
        if neg is None:
            return True
        npb = src[3]
        return (neg._version == npb) if isinstance(npb, int) else same_ids(neg, npb)

    def _uids(self, store: Any) -> Any:
        if not isinstance(store, _HostStore):
            return self.unique
        if store.device.type == "cuda":
            self.on("unique", store.device)  # the batch's one upload (with the inverse)
        return self._unique_batch

    @property
    def weight_rows(self) -> int:
        """Rows the model variable holds for this batch."""
        return self.k if self.compact else self.n

    def matches(self, pos: Any, neg: Any, num_rows: int, dedup: bool) -> bool:
        """Whether ``pos`` then ``neg`` (flattened) are this layout's ids, compared part
        by part (no concatenated copy: most calls of a step find the layout its first
        call made)."""
        if num_rows != self.num_rows or dedup != self.dedup:
            return False
        a = as_index_array(pos).reshape(-1)
        na = a.shape[0]
        if neg is None:
            return na == self.n and same_ids(a, self.ids)
        b = as_index_array(neg).reshape(-1)
        return (na + b.shape[0] == self.n and same_ids(a, self.ids[:na])
                and same_ids(b, self.ids[na:]))

    def last_pos(self) -> np.ndarray:
        """``(k,)`` position of the last occurrence of each unique id."""
        if self._last is None:
            last = np.full(self.k, -1, dtype=np.int64)
            if self.has_dups:
                np.maximum.at(last, self.inverse, np.arange(self.n, dtype=np.int64))
            else:
                last[self.inverse] = np.arange(self.n, dtype=np.int64)
            self._last = last
        return self._last

    def on(self, name: str, device: torch.device) -> torch.Tensor:
        """``inverse`` / ``last`` / ``ids`` as an int64 tensor on ``device`` (cached)."""
        key = (name, device)
        got = self._dev.get(key)
        if got is None and name in ("inverse", "unique", "last") and device.type == "cuda":
            # one upload per batch and device: the inverse (the forward hook), the unique
            # ids (the tables' kernels; handed to the host tables' IndexBatch too) and,
            # where the weight keeps every position, each id's last position (write-back)
            from .._staging import upload

            names = ["inverse", "unique"] + ([] if self.compact or self.identity else ["last"])
            src = {"inverse": np.ascontiguousarray(self.inverse, dtype=np.int64),
                   "unique": self.unique}
            if "last" in names:
                src["last"] = self.last_pos()
            stream = current_stream(device)
            for nm, t in zip(names, upload([src[nm] for nm in names], device, stream)):
                self._dev[(nm, device)] = t
            self._unique_batch._uploaded.setdefault(int(stream.cuda_stream),
                                                    self._dev[("unique", device)])
            got = self._dev.get(key)
        if got is None:
            # only the array asked for (``last`` costs a pass over the ids when first made)
            src = self.last_pos() if name == "last" else {"inverse": self.inverse, "ids": self.ids,
                                                           "unique": self.unique}[name]
            got = _ids_tensor(src, device)
            self._dev[key] = got
        return got

    def _dev_ids(self, store: Any, name: str) -> Optional[torch.Tensor]:
        """Cached device ids for a GPU-resident store (one upload per batch, not per table)."""
        if isinstance(store, _TensorStore) and store.device.type == "cuda":
            return self.on(name, store.device)
        return None

    def gather(self, store: Any, device: torch.device) -> torch.Tensor:
        """The rows in this layout, on ``device``."""
        if self.compact or self.identity:
            return store.gather(self._uids(store), device, self._dev_ids(store, "unique"))
        if store.sorted_helps:  # read host memory in address order, permute on device
            rows = store.gather(self._uids(store), device)
            return rows.index_select(0, self.on("inverse", rows.device))
        return store.gather(self.ids.astype(np.int64, copy=False), device,
                            self._dev_ids(store, "ids"))

    def gather_planes(self, stores: List["_HostStore"], device: torch.device,
                      moves: Optional["_Moves"] = None) -> torch.Tensor:
        """``(len(stores), weight_rows, dim)`` on ``device``: every store's rows in this
        layout, by one fused UVA launch (the caller checked :func:`_fusable`; ``moves``,
        the switcher's prepared launches, when it holds these stores). Stream: the
        current one."""
        from ..host import gather_many

        s0 = stores[0]
        uids = self._uids(s0)
        # planes strided by a rounded capacity: the same geometry recurs from batch to
        # batch, so the fused move's launch arguments are reused
        cap = -(-max(self.k, 1) // _CAP_ROUND) * _CAP_ROUND
        buf = torch.empty((len(stores), cap, s0.dim), dtype=s0.dtype, device=device)[:, :self.k]
        move = moves.prepared("gather", stores, 0, buf) if moves is not None else None
        if move is None:
            gather_many([s.table for s in stores], uids, buf)
        elif self.k:
            move(self.on("unique", device).data_ptr(), self.k, current_stream(device))
        if self.compact or self.identity:
            return buf
        return buf.index_select(1, self.on("inverse", device))

    def scatter_planes(self, stores: List["_HostStore"], planes: torch.Tensor,
                       moves: Optional["_Moves"] = None, lo: int = 0) -> None:
        """The mirror of :meth:`gather_planes`: ``planes[g]`` (this layout's rows) back to
        ``stores[g]``, one write per unique id, by one fused launch (``moves``: as there,
        ``stores`` being its stores from ``lo`` on). Stream: the current one, which
        ``record_stream`` keeps ``planes`` alive for; the tables record their event."""
        from ..host import scatter_many

        planes = planes.detach()
        move = None
        if not (self.compact or self.identity):
            planes = planes.index_select(1, self.on("last", planes.device))
        elif moves is not None:
            move = moves.prepared("scatter", stores, lo, planes)
        if move is None:
            scatter_many([s.table for s in stores], self._uids(stores[0]), planes)
        elif self.k:
            s = current_stream(planes.device)
            planes.record_stream(s)
            move(self.on("unique", planes.device).data_ptr(), self.k, s)
        for st in stores:
            st.version += 1

    def scatter(self, store: Any, rows: torch.Tensor) -> None:
        """Write rows of this layout back, one write per unique id."""
        rows = rows.detach()
        if rows.shape[0] != self.weight_rows:
            raise StpipeValueError(
                f"expected {self.weight_rows} rows for these ids, got {rows.shape[0]}: "
                "afterOptimizerStep must get the ids given to beforeForwardPass"
            )
        if self.compact or self.identity:
            store.scatter(self._uids(store), rows, self._dev_ids(store, "unique"))
        elif not self.has_dups and not store.sorted_helps:
            store.scatter(self.ids.astype(np.int64, copy=False), rows, self._dev_ids(store, "ids"))
        else:
            store.scatter(self._uids(store), rows.index_select(0, self.on("last", rows.device)))


class _Stash:
    """A model switcher's fused gather for one batch: ``planes[0]`` is its weight,
    ``planes[g]`` the rows of optimizer-state store ``stores[g]`` (``g >= 1``), valid for
    the optimizer switcher while that store's ``version`` is still ``versions[g]``.

    The optimizer switcher installs the state rows it takes (:meth:`take`, once each).
    When those exact tensors are still in the optimizer's state at its
    ``afterOptimizerStep``, and no state table was written since the gather, all of them
    go back in one fused launch (:meth:`state_writable`). Each switcher writes only what
    it owns, when it is called, as without the fusing.
    """

    __slots__ = ("planes", "stores", "versions", "taken", "_weight_from", "moves", "__weakref__")

    def __init__(self, planes: torch.Tensor, stores: List["_HostStore"],
                 moves: Optional["_Moves"] = None) -> None:
        self.planes = planes
        self.stores = list(stores)
        #: the gathering switcher's prepared launches, for the write-back (or None)
        self.moves = moves
        self.versions = [st.version for st in stores]
        self.taken: Dict[int, torch.Tensor] = {}  # g -> the tensor installed in the state
        self._weight_from: Optional[weakref.ref] = None

    @property
    def weight_from(self) -> Optional["_ModelSwitch"]:
        """The model switcher whose weight write-back waits for the state's (or None).

        Held weakly: the layout keeps its stash as long as the weight lives, and a
        switcher the user dropped with a write-back pending (its table with it) must
        not live on through it; its rows would go to a table nobody can read.
        """
        ref = self._weight_from
        return ref() if ref is not None else None

    @weight_from.setter
    def weight_from(self, switch: Optional["_ModelSwitch"]) -> None:
        self._weight_from = weakref.ref(switch) if switch is not None else None

    def defers_weight(self, store: Any, w: torch.Tensor, opt: Optional["_OptimizerSwitch"]) -> bool:
        """Whether the model switcher's write-back of ``w`` (the weight over ``store``)
        can wait for the optimizer switcher ``opt`` to write it with its state in one
        launch: this gather read ``store`` and ``opt``'s tables (in this order), ``opt``
        installed every state plane, and ``w`` still holds plane 0."""
        if opt is None or self.stores[0] is not store or self.weight_from is not None:
            return False
        tables = opt._tables or {}
        if len(self.taken) != len(tables) or not _same_objects(list(tables.values()), self.stores[1:]):
            return False
        rows = self.planes[0]
        return w.data_ptr() == rows.data_ptr() and w.shape == rows.shape

    def _index(self, store: Any) -> int:
        for g in range(1, len(self.stores)):
            if self.stores[g] is store:
                return g
        return -1

    def take(self, store: Any) -> Optional[torch.Tensor]:
        """``store``'s gathered rows, once, or ``None`` (not in this gather, written
        since, or already taken: a second ``beforeForwardPass`` reads the table again,
        as without the fused gather)."""
        g = self._index(store)
        if g < 0 or g in self.taken or store.version != self.versions[g]:
            return None
        got = self.taken[g] = self.planes[g]
        return got

    def state_writable(self, state: Dict[str, Any], keys: Dict[str, Any]) -> bool:
        """Whether ``planes[1:]`` can go back as they are: every state store of the
        gather (``keys``: state key -> store) had its plane taken, that very tensor is
        still ``state[key]``, and no write reached the store since the gather."""
        if len(keys) != len(self.stores) - 1 or len(self.taken) != len(keys):
            return False
        for key, store in keys.items():
            g = self._index(store)
            if g < 0 or state.get(key) is not self.taken.get(g) or store.version != self.versions[g]:
                return False
        return True


class _Moves:
    """A model switcher's fused moves, prepared once per plane buffer.

    :meth:`_Layout.gather_planes` allocates its planes per batch from the caching
    allocator, which hands back the same few blocks from step to step; this keeps the
    :func:`stpipe.host._prepare_move` result of each (op, first store, plane count,
    buffer address, plane stride) so a step launches directly, without
    :func:`~stpipe.host.gather_many`'s per-call checks and cache key (the layout's plan
    has range-checked the ids). Valid for one list of stores: :meth:`fusable` forgets
    everything when the stores change (a new table or optimizer state), and the switcher
    drops it when its table goes.
    """

    __slots__ = ("stores", "device", "fused", "_prepared")

    #: prepared moves kept at most (the allocator's blocks recur; more means churn)
    MAX = 16

    def __init__(self) -> None:
        self.stores: Tuple[Any, ...] = ()
        self.device: Optional[torch.device] = None
        self.fused = False
        self._prepared: Dict[Tuple[str, int, int, int, int], Any] = {}

    def fusable(self, stores: List[Any], device: torch.device) -> bool:
        """:func:`_fusable` of ``stores`` on ``device``, asked once per list of stores."""
        if device != self.device or not _same_objects(self.stores, stores):
            self.stores, self.device = tuple(stores), device
            self.fused = _fusable(stores, device)
            self._prepared.clear()
        return self.fused

    def prepared(self, op: str, stores: List[Any], lo: int, planes: torch.Tensor) -> Any:
        """The prepared ``op`` of ``stores`` over ``planes``, a ``(g, k, dim)`` view of a
        ``(g, cap, dim)`` buffer, where ``stores`` are those last given to :meth:`fusable`
        from ``lo`` on; ``None`` otherwise, or where no fused kernel moves them (use the
        ``*_many`` call then)."""
        g = planes.shape[0]
        if not self.fused or g != len(stores) or not _same_objects(stores, self.stores[lo:lo + g]):
            return None
        key = (op, lo, g, planes.data_ptr(), planes.stride(0))
        got = self._prepared.get(key, False)
        if got is False:
            from ..host import _prepare_move

            if len(self._prepared) >= self.MAX:
                self._prepared.clear()
            tables = [s.table for s in stores]
            got = self._prepared[key] = _prepare_move(op, tables, planes)
        return got

    def clear(self) -> None:
        self.stores, self.device, self.fused = (), None, False
        self._prepared.clear()


def _same_objects(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether ``a`` and ``b`` hold the very same objects, in order (identity, not ``==``)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _fusable(stores: List[Any], device: torch.device) -> bool:
    """Whether one fused UVA launch can move all ``stores`` (pinned host tables of one
    shape and dtype on ``device``, CuPy present)."""
    if len(stores) < 2 or not all(isinstance(st, _HostStore) for st in stores):
        return False
    from ..host import _fused_mover

    tables = [st.table for st in stores]
    return tables[0].device == device and _fused_mover(tables) is not None


class _WeakIdMap:
    """Values keyed by an object's identity, each dropped when its key object dies: what
    ``torch.utils.weak.WeakIdKeyDictionary`` does, at one dict lookup and one weakref
    call per :meth:`get` (the switchers look a parameter up 18 times per Adam step; the
    torch class took about 10 us per lookup under cProfile on the H200 host).

    An entry is removed by its own weakref's callback, which checks that the entry is
    still its own, so an id reused by a new object after the old one died is safe.
    """

    __slots__ = ("_d",)

    def __init__(self) -> None:
        self._d: Dict[int, Tuple[weakref.ref, Any]] = {}

    def get(self, key: Any, default: Any = None) -> Any:
        e = self._d.get(id(key))
        if e is not None and e[0]() is key:
            return e[1]
        return default

    def __contains__(self, key: Any) -> bool:
        e = self._d.get(id(key))
        return e is not None and e[0]() is key

    def __setitem__(self, key: Any, value: Any) -> None:
        k, d = id(key), self._d

        def gone(ref: weakref.ref) -> None:
            e = d.get(k)
            if e is not None and e[0] is ref:
                del d[k]

        d[k] = (weakref.ref(key, gone), value)

    def __delitem__(self, key: Any) -> None:
        if key not in self:
            raise KeyError(key)
        del self._d[id(key)]

    def __len__(self) -> int:
        return sum(1 for e in list(self._d.values()) if e[0]() is not None)


#: a weak reference to the optimizer switcher that holds a parameter's per-row state
#: (set by optInit). Weak both ways: the switcher refers to the model, hence to the
#: parameter, so a strong value would keep the key, the switcher and its tables alive
#: for ever.
_opt_switch_of = _WeakIdMap()


def _opt_switch(param: torch.Tensor) -> Optional["_OptimizerSwitch"]:
    ref = _opt_switch_of.get(param)
    return ref() if ref is not None else None

#: the last layout computed for each parameter (shared by its model and optimizer switchers)
_layouts = _WeakIdMap()
#: the dedup choice of the ModelFactory that owns a parameter
_dedup_of = _WeakIdMap()


def _numel(ids: Any) -> int:
    """Element count of tensor or numpy ids (-1 for other kinds)."""
    if isinstance(ids, torch.Tensor):
        return ids.numel()
    if isinstance(ids, np.ndarray):
        return ids.size
    return -1


def _probe(ids: Any, flat: np.ndarray, start: int) -> Any:
    """What tells later whether ``ids`` (found to hold ``flat[start:start + ids.size]``)
    still does (:meth:`_Layout.unchanged`): a tensor's in-place edit counter, a numpy
    array's matching view of ``flat`` (its content is compared: numpy keeps no edit
    counter), ``None`` for other kinds (always compared in full), and for inference
    tensors, which keep no edit counter."""
    if isinstance(ids, torch.Tensor):
        v = _version(ids)  # -1: an inference tensor
        return v if v >= 0 else None
    if isinstance(ids, np.ndarray) and 0 <= start and start + ids.size <= flat.shape[0]:
        return flat[start:start + ids.size].reshape(ids.shape)
    return None


def _layout_for(param: torch.Tensor, pos: Any, neg: Any, num_rows: int,
                call: Optional[str] = None) -> _Layout:
    """The layout of these ids for ``param``; reuses the last one when the ids match.

    ``call`` names the switcher call (``"model-before"``, ``"opt-after"``, ...). A call
    given the very id objects the layout was last checked against, still holding its ids
    (:meth:`_Layout.unchanged`: tensors unedited since by their version counter, numpy
    arrays by one ``memcmp`` of their content, since numpy keeps no edit counter), and
    not yet made on that layout, is a later call of the same step and takes it without
    converting, range-checking or planning the ids again. Any other call compares them
    in full, so ids refilled in place are seen whenever they change (between steps, or
    between an evaluation pass of one switcher and the next step's first call of
    another). ``None``: always compare.
    """
    dedup = _dedup_of.get(param, True)
    last = _layouts.get(param)
    if last is not None:
        calls = last.calls
        if (call is not None and call not in calls and num_rows == last.num_rows
                and dedup == last.dedup and last.unchanged(pos, neg)):
            calls.add(call)
            return last
        if last.matches(pos, neg, num_rows, dedup):
            last.checked(pos, neg, call)
            return last
    flat = _flat_ids(pos, neg)
    try:
        lay = _Layout(flat, num_rows, dedup, copy=neg is None)  # two parts: concatenated anew
    except StpipeIndexError:
        # name the argument that holds the bad id
        check_ids(pos, num_rows)
        if neg is not None:
            try:
                check_ids(neg, num_rows)
            except StpipeIndexError as exc:
                raise StpipeIndexError(f"retrievedNegIndexes: {exc}") from None
        raise
    lay.checked(pos, neg, call)
    _layouts[param] = lay
    return lay


# ---------------------------------------------------------------------------------------
# shared pieces of the switchers
# ---------------------------------------------------------------------------------------
def _variable_transformer(batchSize: int, posPerBatch: int, negPerBatch: Optional[int] = None):
    n_pos = batchSize * posPerBatch
    pos = np.arange(n_pos).reshape(batchSize, posPerBatch)
    if negPerBatch is None:
        return pos
    neg = np.arange(n_pos, n_pos + batchSize * negPerBatch).reshape(batchSize, negPerBatch)
    return pos, neg


def _as_device(deviceType: Any) -> torch.device:
    """``deviceType`` of the ``Pytorch*`` classes as a ``cpu`` or ``cuda`` device.

    Raises:
        StpipeValueError: any other device or string.
    """
    try:
        dev = torch.device(deviceType)
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise StpipeValueError(
            f"deviceType: expected 'cuda' (tables in GPU memory) or 'cpu' (host memory), "
            f"got {deviceType!r}"
        )
    return dev


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise StpipeTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if int(value) <= 0:
        raise StpipeValueError(f"{name} must be > 0, got {value}")
    return int(value)


def _install(w: torch.Tensor, rows: torch.Tensor) -> None:
    """``w.data = rows``, safe when the row count changes between batches.

    Autograd caches a leaf's gradient accumulator together with the leaf's shape, and
    ``set_data`` renews it only when the dtype or device changes; with deduplication the
    row count varies from batch to batch, so a graph still alive from the previous step
    (e.g. the user's ``loss`` variable) would make the next backward fail with "invalid
    gradient ... expected shape compatible with [k_old, dim]". Passing through a tensor of
    another dtype drops the cached accumulator, so the next forward builds a fresh one.
    """
    with torch.no_grad():
        if w.grad is not None and w.grad.shape != rows.shape:
            w.grad = None  # a stale gradient of another batch's shape
        if w.shape != rows.shape:
            w.data = _other_empty(rows)
        w.data = rows


def _weight_of(model_variable: Any) -> torch.nn.Parameter:
    w = getattr(model_variable, "weight", None)
    if not isinstance(w, torch.Tensor):
        raise StpipeTypeError(
            "model_variable must be an embedding module with a .weight parameter (e.g. "
            f"model.u_embeddings), got {type(model_variable).__name__}"
        )
    return w


class _TableSwitch:
    """Common part of the model switchers: one table, init, files, numpy."""

    _cupy_named = False
    #: a weight write-back left for the optimizer switcher to fuse with its own:
    #: ``(layout, stash)``; written by :meth:`_require` before anything else reads or
    #: writes the table (see :meth:`_ModelSwitch.afterOptimizerStep`)
    _pending: Optional[Tuple["_Layout", "_Stash"]] = None
    #: a model switcher's prepared fused launches (:class:`_Moves`; set by ``_attach``)
    _moves: Optional["_Moves"] = None
    #: this switcher's latest fused gather (layouts hold stashes weakly)
    _stash: Optional[_Stash] = None

    def _setup_table(self, total_classes: Any, embed_dimension: Any, datatype: Any) -> None:
        self.total_classes = _check_count("total_classes", total_classes)
        self.embed_dimension = _check_count("embed_dimension", embed_dimension)
        self._dtype = _as_dtype(datatype)
        self._store: Optional[Union[_TensorStore, _HostStore]] = None

    def _rows_device(self) -> torch.device:
        return torch.device("cpu")

    def _fresh(self, fill: Callable[[Union[_TensorStore, _HostStore]], None]) -> None:
        """Replace the table by a new one filled by ``fill(store)``.

        The old table is freed first, so the peak is one table. A fill that raises
        leaves no table (the half-filled one is freed too): the next use says there is
        none instead of training on rows that were never written.
        """
        self._close_store()
        store = _new_store(self.total_classes, self.embed_dimension, self._dtype,
                           self._where, self._rows_device())
        try:
            fill(store)
        except BaseException:
            store.close()
            raise
        self._store = store

    def _require(self) -> Union[_TensorStore, _HostStore]:
        if self._store is None:
            raise StpipeRuntimeError(
                f"{type(self).__name__} has no table yet: call zerosInit(), "
                "uniformDistributionInit(), normalDistributionInit()"
                + (", customInit()" if hasattr(self, "customInit") else "")
                + " or a load method first"
            )
        if self._pending is not None:
            self._write_pending()
        return self._store

    def _close_store(self) -> None:
        """Free the table, forgetting a write-back deferred for it (the table is being
        replaced or closed)."""
        self._drop_pending()
        self._stash = None
        if self._moves is not None:
            self._moves.clear()
        if self._store is not None:
            self._store.close()
            self._store = None

    def _drop_pending(self) -> Optional[Tuple["_Layout", "_Stash"]]:
        """Forget the deferred write-back (returned, or ``None``) and unlink it from its
        stash, so ``stash.weight_from is self`` exactly while it is pending."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[1].weight_from = None
        return pending

    def _write_pending(self) -> None:
        """Write the deferred weight rows now, as the model switcher's own write-back."""
        lay, stash = self._drop_pending()
        lay.scatter(self._store, stash.planes[0])

    # -- initialisers (SpeedTorch names) --------------------------------------------
    def zerosInit(self) -> None:
        """Create the table filled with zeros."""
        self._fresh(lambda st: st.zeros_())

    def uniformDistributionInit(self, low: float, high: float) -> None:
        """Create the table with U(low, high) draws (torch's RNG). ``low > high`` draws
        between the two, as SpeedTorch's ``cupy.random.uniform`` did.

        Raises:
            ValueError: a bound that is NaN (checked before the old table is replaced).
        """
        lo, hi = float(low), float(high)
        if lo != lo or hi != hi:
            raise StpipeValueError(
                f"uniformDistributionInit: expected numbers, got low={low}, high={high}"
            )
        self._fresh(lambda st: st.uniform_(min(lo, hi), max(lo, hi)))

    def normalDistributionInit(self, mean: float, stdDev: float) -> None:
        """Create the table with N(mean, stdDev²) draws (torch's RNG).

        Raises:
            ValueError: ``stdDev < 0`` (checked before the old table is replaced).
        """
        if not float(stdDev) >= 0:
            raise StpipeValueError(f"normalDistributionInit: expected stdDev >= 0, got {stdDev}")
        self._fresh(lambda st: st.normal_(mean, stdDev))

    def variableTransformer(self, batchSize: int, posPerBatch: int, negPerBatch: Optional[int] = None):
        """Dummy inputs for the model: positions ``0..batchSize*posPerBatch-1`` shaped
        ``(batchSize, posPerBatch)``, and with ``negPerBatch`` a second array continuing
        the numbering, shaped ``(batchSize, negPerBatch)`` (numpy int64)."""
        return _variable_transformer(batchSize, posPerBatch, negPerBatch)

    def getNumpyVersion(self) -> np.ndarray:
        """A numpy copy of the full ``(total_classes, embed_dimension)`` table (waits for
        pending transfers of this table)."""
        return self._require().numpy()

    def _save_npy(self, saveFileName: PathLike) -> None:
        _save_store_npy(self._require(), _npy_name(saveFileName),
                        (self.total_classes, self.embed_dimension))

    def _load_npy(self, loadFileName: PathLike) -> None:
        store, _ = _load_store(loadFileName, self._where, self._rows_device(),
                               expect=(self.total_classes, self.embed_dimension),
                               dtype=self._dtype)
        self._close_store()
        self._store = store


# ---------------------------------------------------------------------------------------
# model switchers
# ---------------------------------------------------------------------------------------
class _RemapHook:
    """The one forward pre-hook a model switcher puts on its embedding module.

    It remaps the dummy positions by the layout of its *owner*: the switcher whose rows
    the module's weight holds. A newer switcher on the same module (a new run, a reload)
    takes the hook over instead of adding a second one, so positions are never remapped
    twice; an older switcher that swaps rows in again takes it back. The hook refers to
    its owner weakly and leaves the module when the owner is freed, so the module keeps
    no dropped switcher (nor its full table) alive. Pickled or deep-copied with the
    module, it becomes a hook without an owner, which remaps nothing.
    """

    __slots__ = ("_owner", "_module", "_handle", "__weakref__")

    def __init__(self, module: Optional[torch.nn.Module] = None) -> None:
        self._owner: Optional[weakref.ref] = None
        self._module = weakref.ref(module) if module is not None else None
        self._handle = (module.register_forward_pre_hook(self, with_kwargs=True)
                        if module is not None else None)

    @classmethod
    def claim(cls, module: torch.nn.Module, switch: "_ModelSwitch") -> "_RemapHook":
        """The module's hook (registered if it has none), now owned by ``switch``."""
        hook = _remap_hooks.get(module)
        if hook is None:
            hook = cls(module)
            _remap_hooks[module] = hook
        me = weakref.ref(hook)

        def gone(ref: weakref.ref) -> None:  # the owner was freed
            h = me()
            if h is not None and h._owner is ref:
                h.remove()

        hook._owner = weakref.ref(switch, gone)
        return hook

    def owner(self) -> Optional["_ModelSwitch"]:
        ref = self._owner
        return ref() if ref is not None else None

    def remove(self) -> None:
        """Take the hook off its module."""
        self._owner = None
        if self._handle is not None:
            self._handle.remove()
        module = self._module() if self._module is not None else None
        if module is not None and _remap_hooks.get(module) is self:
            del _remap_hooks[module]

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict):
        ref = self._owner
        switch = ref() if ref is not None else None
        return None if switch is None else switch._remap_hook(module, args, kwargs)

    def __reduce__(self):
        return (_RemapHook, ())  # no owner: the switcher stays with the original module


#: the :class:`_RemapHook` of each embedding module that has one (weak keys)
_remap_hooks = _WeakIdMap()


class _ModelSwitch(_TableSwitch):
    def _attach(self, model_variable: Any, dedup: bool) -> None:
        if not isinstance(model_variable, torch.nn.Module):
            raise StpipeTypeError(
                "model_variable must be an nn.Module with a .weight (e.g. an nn.Embedding), "
                f"got {type(model_variable).__name__}"
            )
        self.model_variable = model_variable
        w = _weight_of(model_variable)
        self._dedup = bool(dedup)
        _dedup_of[w] = self._dedup
        self._layout: Optional[_Layout] = None
        #: prepared fused launches over this table and its optimizer's state tables
        self._moves = _Moves()
        #: the module's forward pre-hook, owned by this switcher while the weight holds
        #: its rows (:class:`_RemapHook`; taken over by a newer switcher of the module)
        self._hook: Optional[_RemapHook] = _RemapHook.claim(model_variable, self)

    def _own_hook(self) -> None:
        """Make this switcher the owner of its module's remapping hook (again: a newer
        switcher of the module took it over, or :meth:`close` removed it)."""
        self._hook = _RemapHook.claim(self.model_variable, self)
        _dedup_of[_weight_of(self.model_variable)] = self._dedup

    def _rows_device(self) -> torch.device:
        return _weight_of(self.model_variable).device

    def _remap_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict):
        """Forward pre-hook: dummy position ``i`` → row ``inverse[i]`` (dedup only)."""
        lay = self._layout
        if lay is None or not lay.compact:
            return None
        if args and isinstance(args[0], torch.Tensor):
            inp = args[0]
            return (self._remap(lay, inp),) + tuple(args[1:]), kwargs
        if isinstance(kwargs.get("input"), torch.Tensor):
            kwargs = dict(kwargs)
            kwargs["input"] = self._remap(lay, kwargs["input"])
            return args, kwargs
        return None

    @staticmethod
    def _remap(lay: _Layout, inp: torch.Tensor) -> torch.Tensor:
        inverse = lay.on("inverse", inp.device)
        flat = inp.reshape(-1)
        if flat.dtype not in (torch.int32, torch.int64):
            flat = flat.long()
        return inverse.index_select(0, flat).view(inp.shape)

    def beforeForwardPass(self, retrievedPosIndexes: Any, retrievedNegIndexes: Any = None) -> None:
        """Load the rows of the batch's ids into the model variable's weight.

        The ids are ``retrievedPosIndexes`` flattened, then ``retrievedNegIndexes``
        flattened. Without duplicates, weight row ``j`` holds the ``j``-th id (as in
        SpeedTorch). With duplicates the weight holds the unique rows (ascending) and
        the module's forward remaps dummy positions onto them (see the module docs).

        With a pinned table (CuPy present) and an :class:`OptimizerFactory` of the same
        weight, the optimizer's state rows of the batch come in the same UVA launch; that
        switcher's ``beforeForwardPass`` then installs them instead of reading its
        tables again (unless they were written since).

        Streams: the gather runs on the current stream of the weight's device (a host
        table first waits, by event, for its last scatter); nothing syncs the device.

        Raises:
            IndexError: an id outside ``[0, total_classes)``.
            TypeError: non-integer ids.
            RuntimeError: no table yet (call an initialiser).
        """
        store = self._require()
        hook = self._hook
        if hook is None or hook.owner() is not self:
            self._own_hook()
        w = _weight_of(self.model_variable)
        lay = _layout_for(w, retrievedPosIndexes, retrievedNegIndexes, self.total_classes, "model-before")
        opt = _opt_switch(w)
        state_stores = list(opt._tables.values()) if opt is not None and opt._tables else []
        stores = [store] + state_stores
        moves = self._moves
        if moves.fusable(stores, w.device):
            # the weight and the optimizer's state rows of the batch in one launch; the
            # optimizer switcher's beforeForwardPass installs the state planes
            planes = lay.gather_planes(stores, w.device, moves)
            self._stash = lay.stash = _Stash(planes, stores, moves)
            rows = planes[0]
        else:
            self._stash = None
            rows = lay.gather(store, w.device)
        _install(w, rows)
        self._layout = lay

    def afterOptimizerStep(self, retrievedPosIndexes: Any, retrievedNegIndexes: Any = None) -> None:
        """Write the model variable's weight rows back to the batch's ids (each unique id
        once).

        Streams: the scatter reads the weight on the current stream of its device, after
        the optimizer step queued there; a host table keeps the rows alive
        (``record_stream``) and records an event that later gathers wait on.

        Raises:
            IndexError: an id outside ``[0, total_classes)``.
            ValueError: the weight does not hold these ids' rows (different ids than at
                :meth:`beforeForwardPass`).
        """
        store = self._require()  # writes a write-back still deferred from before
        w = _weight_of(self.model_variable)
        lay = _layout_for(w, retrievedPosIndexes, retrievedNegIndexes, self.total_classes, "model-after")
        stash = lay.stash
        if stash is not None and stash.defers_weight(store, w, _opt_switch(w)):
            # the optimizer switcher's afterOptimizerStep writes these rows in the same
            # launch as its state; anything that touches the table first writes them
            self._pending = (lay, stash)
            stash.weight_from = self
            return
        lay.scatter(store, w.data)

    def close(self) -> None:
        """Remove the forward pre-hook (unless a newer switcher of the module owns it)
        and free the table."""
        hook = getattr(self, "_hook", None)
        if hook is not None and hook.owner() is self:
            hook.remove()
        self._hook = None
        self._close_store()


class ModelFactory(_ModelSwitch):
    """SpeedTorch's CuPy-backed model switcher for an embedding's weight.

    Args:
        model_variable: the embedding module (``model.u_embeddings``); its ``.weight``
            receives the batch rows.
        total_classes: rows of the full table.
        embed_dimension: columns of the full table.
        datatype: ``'float32'`` (default), ``'float16'`` or a torch dtype.
        CPUPinn: keep the table in pinned host memory (a :class:`stpipe.host.HostTable`)
            instead of GPU memory (a torch tensor; a CPU tensor where CUDA is missing).
        dedup: (stpipe only, keyword) deduplicate batch ids; see the module docs.

    Files: :meth:`saveCupy` / :meth:`loadCupy` (``.npy``, readable by SpeedTorch).
    """

    _cupy_named = True

    def __init__(self, model_variable: Any, total_classes: int, embed_dimension: int,
                 datatype: Any = "float32", CPUPinn: bool = False, *, dedup: bool = True) -> None:
        self._setup_table(total_classes, embed_dimension, datatype)
        self.datatype = datatype
        self.CPUPinn = CPUPinn
        self._attach(model_variable, dedup)
        w = _weight_of(model_variable)
        self._where = _placement(on_gpu=not CPUPinn, pin=bool(CPUPinn), cupy_named=True,
                                 what=type(self).__name__,
                                 gpu_device=w.device if w.device.type == "cuda" else None)

    def saveCupy(self, saveFileName: PathLike) -> None:
        """Save the table as ``.npy`` (``np.save`` naming: ``.npy`` appended if missing),
        atomically."""
        self._save_npy(saveFileName)

    def loadCupy(self, loadFileName: PathLike) -> None:
        """Replace the table with a ``.npy`` file of shape ``(total_classes,
        embed_dimension)`` (converted to ``datatype``).

        Raises:
            ValueError: the file's shape differs, or it needs unpickling.
        """
        self._load_npy(loadFileName)


class PytorchModelFactory(_ModelSwitch):
    """SpeedTorch's torch-backed model switcher.

    Args:
        model_variable, total_classes, embed_dimension, datatype: as :class:`ModelFactory`.
        deviceType: ``'cuda'`` (table in GPU memory) or ``'cpu'`` (host memory).
        pinType: page-lock a ``'cpu'`` table.
        dedup: (stpipe only, keyword) see the module docs.
    """

    def __init__(self, model_variable: Any, total_classes: int, embed_dimension: int,
                 datatype: Any = "float32", deviceType: Any = "cuda", pinType: bool = False,
                 *, dedup: bool = True) -> None:
        self._setup_table(total_classes, embed_dimension, datatype)
        dev = _as_device(deviceType)
        self.dtype = self._dtype
        self.deviceType = deviceType
        self.pinType = pinType
        self._attach(model_variable, dedup)
        self._where = _placement(on_gpu=dev.type == "cuda", pin=bool(pinType),
                                 cupy_named=False, what=type(self).__name__,
                                 gpu_device=dev if dev.type == "cuda" else None)

    def customInit(self, initFunction: Callable[..., Any], *args: Any) -> None:
        """Create the table and fill it with ``initFunction(table, *args)`` (any
        ``torch.nn.init`` function).

        On a host table (``deviceType='cpu'``) an elementwise function is applied
        chunk-wise with the full table's fan-in/fan-out; one that is not (``orthogonal_``,
        ``eye_``, ``sparse_``) runs on a full float32 tensor of the table's shape, then
        is copied in. Memory: that is a transient second copy of the table in host RAM
        (4 bytes per element, freed before this returns) plus what the function needs
        (``orthogonal_``: a QR of the whole table), as SpeedTorch needed for its one
        tensor.

        Raises:
            ValueError: ``initFunction`` fails on a table of this shape (e.g.
                ``dirac_``, which takes 3 to 5 dimensions). The old table was freed
                first and no half-filled one is kept: until another init or load, the
                switcher has no table.
        """
        self._fresh(lambda st: st.init_(initFunction, *args))

    def saveTorch(self, saveFileName: PathLike) -> None:
        """``torch.save`` the table as a CPU tensor, atomically."""
        t = self._require().cpu_tensor()
        _atomic_write(os.fspath(saveFileName), lambda f: torch.save(t, f))

    def loadTorch(self, loadFileName: PathLike) -> None:
        """Replace the table with a tensor saved by :meth:`saveTorch` (or by SpeedTorch).

        Loads with ``weights_only=True`` onto the CPU, then places it.

        Raises:
            ValueError: not a ``(total_classes, embed_dimension)`` tensor, or a file
                ``torch.load(..., weights_only=True)`` cannot read.
        """
        path = os.fspath(loadFileName)
        try:
            t = torch.load(path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StpipeValueError(
                f"{path}: expected a tensor saved by torch.save (read with "
                f"weights_only=True), got a file torch.load cannot read that way ({first}); "
                "stpipe refuses files that need unpickling other objects"
            ) from None
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (self.total_classes, self.embed_dimension):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise StpipeValueError(
                f"{path}: expected a tensor of shape "
                f"{(self.total_classes, self.embed_dimension)}, got {got}"
            )
        self._fresh(lambda st: st.copy_from(t.to(self._dtype)))


class GPUPytorchModelFactory(PytorchModelFactory):
    """SpeedTorch's older name: :class:`PytorchModelFactory` with the table on the GPU."""

    def __init__(self, model_variable: Any, total_classes: int, embed_dimension: int,
                 datatype: Any = torch.float, *, dedup: bool = True) -> None:
        super().__init__(model_variable, total_classes, embed_dimension, datatype,
                         deviceType="cuda", pinType=False, dedup=dedup)


class CPUPytorchModelFactory(PytorchModelFactory):
    """SpeedTorch's older name: :class:`PytorchModelFactory` with the table in pinned
    host memory."""

    def __init__(self, model_variable: Any, total_classes: int, embed_dimension: int,
                 datatype: Any = torch.float, *, dedup: bool = True) -> None:
        super().__init__(model_variable, total_classes, embed_dimension, datatype,
                         deviceType="cpu", pinType=True, dedup=dedup)


# ---------------------------------------------------------------------------------------
# optimizer state
# ---------------------------------------------------------------------------------------
def _scalar(x: Any) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _rows_spec(name: str, group: dict, defaults: dict) -> List[Tuple[str, float]]:
    """Per-row state keys of optimizer ``name`` and the value of a never-seen row
    (from ``torch/optim/*.py``: zeros unless noted)."""
    g = lambda key, default=None: group.get(key, defaults.get(key, default))  # noqa: E731
    if name in ("Adam", "AdamW"):
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if g("amsgrad", False) else [])
        return [(k, 0.0) for k in keys]
    if name in ("SparseAdam", "NAdam", "RAdam"):
        return [("exp_avg", 0.0), ("exp_avg_sq", 0.0)]
    if name == "Adamax":
        return [("exp_avg", 0.0), ("exp_inf", 0.0)]
    if name == "Adagrad":
        return [("sum", _scalar(g("initial_accumulator_value", 0.0)))]
    if name == "Adadelta":
        return [("square_avg", 0.0), ("acc_delta", 0.0)]
    if name == "RMSprop":
        keys = ["square_avg"]
        if g("momentum", 0) > 0:
            keys.append("momentum_buffer")
        if g("centered", False):
            keys.append("grad_avg")
        return [(k, 0.0) for k in keys]
    if name == "Rprop":
        return [("prev", 0.0), ("step_size", _scalar(g("lr")))]
    if name == "ASGD":
        return [("ax", 0.0)]
    if name == "SGD":
        # torch sets buf = grad on a parameter's first step; 0 * momentum + grad is the
        # same for dampening=0 (the default).
        return [("momentum_buffer", 0.0)] if g("momentum", 0) != 0 else []
    raise AssertionError(name)  # pragma: no cover - guarded by SUPPORTED_OPTIMIZERS


#: optimizers the optimizer switchers support (the documented nine, plus SGD, NAdam, RAdam)
SUPPORTED_OPTIMIZERS = ("SparseAdam", "Adagrad", "Adadelta", "Adamax", "Adam", "AdamW",
                        "ASGD", "RMSprop", "Rprop", "SGD", "NAdam", "RAdam")


def _optimizer_kind(opt: torch.optim.Optimizer) -> str:
    for cls in type(opt).__mro__:
        if cls.__module__.startswith("torch.optim") and cls.__name__ in SUPPORTED_OPTIMIZERS:
            return cls.__name__
    raise StpipeValueError(
        f"optimizer {type(opt).__name__} is not supported by the SpeedTorch switchers; "
        f"expected one of {', '.join(SUPPORTED_OPTIMIZERS)} (or a subclass)"
    )


def _scalar_dtype(fused: bool = False) -> torch.dtype:
    try:
        from torch.optim.optimizer import _get_scalar_dtype

        return _get_scalar_dtype(is_fused=fused)
    except (ImportError, TypeError):  # pragma: no cover - older torch
        return torch.float32


def _init_scalar_state(kind: str, group: dict, p: torch.Tensor, state: dict) -> None:
    """Create the scalar state of a fresh parameter as ``torch.optim`` does (its
    ``_init_group``), so that installing per-row state does not skip it."""
    fused = bool(group.get("fused") or False)
    capturable = bool(group.get("capturable") or False)
    dt = _scalar_dtype(fused)

    def step() -> torch.Tensor:
        on_device = capturable or (fused and kind in ("Adam", "AdamW", "Adagrad"))
        if on_device:
            return torch.zeros((), dtype=dt, device=p.device)
        return torch.tensor(0.0, dtype=_scalar_dtype())

    if kind == "SGD":
        return
    if kind == "SparseAdam":
        state["step"] = 0
    elif kind == "ASGD":
        state["step"] = torch.zeros((), device=p.device, dtype=_scalar_dtype())
        state["eta"] = torch.as_tensor(_scalar(group["lr"]), device=p.device,
                                       dtype=_scalar_dtype()).clone().detach()
        state["mu"] = torch.ones((), device=p.device, dtype=_scalar_dtype())
    elif kind == "NAdam":
        state["step"] = step()
        state["mu_product"] = (torch.ones((), dtype=_scalar_dtype(), device=p.device)
                               if capturable else torch.tensor(1.0, dtype=_scalar_dtype()))
    else:
        state["step"] = step()


def _find_param(model: torch.nn.Module, variable_name: str) -> torch.nn.Parameter:
    """``model.<variable_name>.weight`` (SpeedTorch matched parameter names minus
    ``.weight``)."""
    if not isinstance(model, torch.nn.Module):
        raise StpipeTypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(variable_name, str):
        raise StpipeTypeError(f"variable_name must be a str, got {type(variable_name).__name__}")
    for name in (variable_name + ".weight", variable_name):
        try:
            return model.get_parameter(name)
        except AttributeError:
            continue
    names = [n[: -len(".weight")] for n, _ in model.named_parameters() if n.endswith(".weight")]
    raise StpipeValueError(
        f"model has no variable {variable_name!r} with a .weight; expected one of {names}"
    )


class _OptimizerSwitch:
    """Common part of the optimizer switchers."""

    _cupy_named = False

    def _setup_opt(self, given_optimizer: Any, total_classes: Any, embed_dimension: Any,
                   model: Any, variable_name: str, dtype: Any) -> None:
        if not isinstance(given_optimizer, torch.optim.Optimizer):
            raise StpipeTypeError(
                f"given_optimizer must be a torch.optim.Optimizer, got {type(given_optimizer).__name__}"
            )
        self.given_optimizer = given_optimizer
        self.total_classes = _check_count("total_classes", total_classes)
        self.embed_dimension = _check_count("embed_dimension", embed_dimension)
        self.model = model
        self.variable_name = variable_name
        self._dtype = _as_dtype(dtype, "dtype")
        self._param = _find_param(model, variable_name)
        if self._param.dim() != 2 or self._param.shape[1] != self.embed_dimension:
            raise StpipeValueError(
                f"model.{variable_name}.weight has shape {tuple(self._param.shape)}, expected "
                f"(rows, {self.embed_dimension})"
            )
        self._group = None
        for group in given_optimizer.param_groups:
            if any(q is self._param for q in group["params"]):
                self._group = group
        if self._group is None:
            raise StpipeValueError(
                f"model.{variable_name}.weight is not among given_optimizer's parameters"
            )
        self._kind = _optimizer_kind(given_optimizer)
        self._spec = _rows_spec(self._kind, self._group, given_optimizer.defaults)
        #: the per-row state keys (SpeedTorch's name)
        self.optVarList = [k for k, _ in self._spec]
        self._tables: Optional[Dict[str, Union[_TensorStore, _HostStore]]] = None

    def optInit(self) -> None:
        """Create one ``(total_classes, embed_dimension)`` table per per-row state key,
        every row at the optimizer's initial value (Adagrad's
        ``initial_accumulator_value``, Rprop's ``lr`` for ``step_size``, else 0)."""
        self.close()
        self._spec = _rows_spec(self._kind, self._group, self.given_optimizer.defaults)
        self.optVarList = [k for k, _ in self._spec]
        tables = {}
        for key, value in self._spec:
            store = _new_store(self.total_classes, self.embed_dimension, self._dtype,
                               self._where, self._param.device)
            if value == 0.0:
                store.zeros_()
            else:
                store.fill_(value)
            tables[key] = store
        self._tables = tables
        _opt_switch_of[self._param] = weakref.ref(self)

    def _require(self) -> Dict[str, Union[_TensorStore, _HostStore]]:
        if self._tables is None:
            raise StpipeRuntimeError(f"{type(self).__name__}: call optInit() first")
        return self._tables

    def beforeForwardPass(self, retrievedPosIndexes: Any, retrievedNegIndexes: Any = None) -> None:
        """Install the batch's rows of every per-row state table in
        ``given_optimizer.state[weight]`` (same layout as the model switcher's weight, in
        the weight's dtype: state tables of another ``dtype`` are converted).

        A parameter without state gets its scalar state created as the optimizer would
        (``step`` = 0, ASGD ``eta`` = lr, ``mu`` = 1, ...). Streams as
        :meth:`ModelFactory.beforeForwardPass`.

        Raises:
            IndexError: an id outside ``[0, total_classes)``.
            RuntimeError: :meth:`optInit` was not called.
        """
        tables = self._require()
        p = self._param
        lay = _layout_for(p, retrievedPosIndexes, retrievedNegIndexes, self.total_classes, "opt-before")
        state = self.given_optimizer.state[p]
        if len(state) == 0:
            _init_scalar_state(self._kind, self._group, p, state)
        stash = lay.stash
        for key, store in tables.items():
            got = stash.take(store) if stash is not None else None
            rows = got if got is not None else lay.gather(store, p.device)
            if rows.dtype != p.dtype:
                # state tables of another dtype (dtype='float16' for a float32 model):
                # the optimizers' kernels want the parameter's dtype; the write-back
                # converts to the table's again
                rows = rows.to(p.dtype)
            state[key] = rows

    def afterOptimizerStep(self, retrievedPosIndexes: Any, retrievedNegIndexes: Any = None) -> None:
        """Write the per-row state rows of the batch back to their tables (each unique id
        once). Keys the optimizer has not created (no step yet) are skipped. State rows
        installed from the model switcher's fused gather, still in the optimizer's state
        as installed, go back in one launch for all keys.

        Raises:
            IndexError: an id outside ``[0, total_classes)``.
            ValueError: state rows of another batch's shape.
        """
        tables = self._require()
        p = self._param
        lay = _layout_for(p, retrievedPosIndexes, retrievedNegIndexes, self.total_classes, "opt-after")
        state = self.given_optimizer.state.get(p, {})
        stash = lay.stash
        owner = stash.weight_from if stash is not None else None  # its write-back waits
        if stash is not None and stash.state_writable(state, tables):
            # the state rows installed from the model switcher's fused gather, stepped
            # in place: every state table in one launch, with the weight rows when the
            # model switcher left them for this launch
            if owner is not None:
                owner._drop_pending()
                lay.scatter_planes(stash.stores, stash.planes, stash.moves)
            else:
                lay.scatter_planes(stash.stores[1:], stash.planes[1:], stash.moves, lo=1)
            lay.stash = None
            return
        if owner is not None:
            owner._write_pending()  # the weight first, as without the deferral
        for key, store in tables.items():
            t = state.get(key)
            if isinstance(t, torch.Tensor):
                lay.scatter(store, t)

    def getNumpyVersion(self) -> Dict[str, np.ndarray]:
        """(stpipe addition) ``{state key: full table as numpy}``."""
        return {k: s.numpy() for k, s in self._require().items()}

    def close(self) -> None:
        """Free the state tables."""
        for store in (self._tables or {}).values():
            store.close()
        self._tables = None
        if _opt_switch(self._param) is self:
            del _opt_switch_of[self._param]


class OptimizerFactory(_OptimizerSwitch):
    """SpeedTorch's CuPy-backed switcher for an embedding's optimizer state.

    Args:
        given_optimizer: a ``torch.optim`` optimizer holding ``model.<variable_name>.weight``
            (see :data:`SUPPORTED_OPTIMIZERS`; Rprop may be switched before or after its
            first step).
        total_classes, embed_dimension: the full table's shape.
        model: the model.
        variable_name: the embedding's attribute name (``'u_embeddings'``).
        dtype: ``'float32'`` (default), ``'float16'`` or a torch dtype of the state tables.
            Rows are installed in the parameter's dtype for the step and stored back in
            this one (so float16 tables halve the state's memory for a float32 model;
            values under float16's smallest subnormal, 6e-8, such as Adam's
            ``exp_avg_sq`` for gradients under about 8e-3, are stored as 0 there;
            ``'bfloat16'`` keeps float32's range).
        CPUPinn: keep the state tables in pinned host memory instead of GPU memory.

    Raises:
        TypeError: not an optimizer/model.
        ValueError: an unsupported optimizer, an unknown variable, or a weight that is
            not in the optimizer.
    """

    _cupy_named = True

    def __init__(self, given_optimizer: Any, total_classes: int, embed_dimension: int,
                 model: Any, variable_name: str, dtype: Any = "float32",
                 CPUPinn: bool = False) -> None:
        self._setup_opt(given_optimizer, total_classes, embed_dimension, model,
                        variable_name, dtype)
        self.datatype = dtype
        self.CPUPinn = CPUPinn
        dev = self._param.device
        self._where = _placement(on_gpu=not CPUPinn, pin=bool(CPUPinn), cupy_named=True,
                                 what=type(self).__name__,
                                 gpu_device=dev if dev.type == "cuda" else None)


class PytorchOptimizerFactory(_OptimizerSwitch):
    """SpeedTorch's torch-backed optimizer-state switcher.

    Args:
        given_optimizer, total_classes, embed_dimension, model, variable_name, dtype: as
            :class:`OptimizerFactory`.
        deviceType: ``'cuda'`` (tables in GPU memory) or ``'cpu'`` (host memory).
        pinType: page-lock ``'cpu'`` tables.
    """

    def __init__(self, given_optimizer: Any, total_classes: int, embed_dimension: int,
                 model: Any, variable_name: str, dtype: Any = "float32",
                 deviceType: Any = "cuda", pinType: bool = False) -> None:
        self._setup_opt(given_optimizer, total_classes, embed_dimension, model,
                        variable_name, dtype)
        dev = _as_device(deviceType)
        self.dtype = self._dtype
        self.deviceType = deviceType
        self.pinType = pinType
        self._where = _placement(on_gpu=dev.type == "cuda", pin=bool(pinType),
                                 cupy_named=False, what=type(self).__name__,
                                 gpu_device=dev if dev.type == "cuda" else None)


class GPUPytorchOptimizerFactory(PytorchOptimizerFactory):
    """SpeedTorch's older name: :class:`PytorchOptimizerFactory` with tables on the GPU."""

    def __init__(self, given_optimizer: Any, total_classes: int, embed_dimension: int,
                 model: Any, variable_name: str, dtype: Any = torch.float) -> None:
        super().__init__(given_optimizer, total_classes, embed_dimension, model,
                         variable_name, dtype, deviceType="cuda", pinType=False)


class CPUPytorchOptimizerFactory(PytorchOptimizerFactory):
    """SpeedTorch's older name: :class:`PytorchOptimizerFactory` with tables in pinned
    host memory."""

    def __init__(self, given_optimizer: Any, total_classes: int, embed_dimension: int,
                 model: Any, variable_name: str, dtype: Any = torch.float) -> None:
        super().__init__(given_optimizer, total_classes, embed_dimension, model,
                         variable_name, dtype, deviceType="cpu", pinType=True)


# ---------------------------------------------------------------------------------------
# DataGadget
# ---------------------------------------------------------------------------------------
def _distinct(flat: np.ndarray, num_rows: int, ids_dev: Optional[torch.Tensor] = None) -> bool:
    """True when the ``(n,)`` checked ids hold no repeat (callers pass strictly increasing
    ids by first: :func:`stpipe.planner.scan_ids` tells them).

    Ids already on the GPU (a GPU-resident table) are sorted there and one flag is read
    back (a wait on the current stream, not the device: measured faster than the host
    pass for 131,072 ids over 10M rows); host ids get the compiled planner's O(n) bitmap
    pass, which never waits on the device.
    """
    if ids_dev is not None:
        s = torch.sort(ids_dev).values
        return not bool((s[1:] == s[:-1]).any())  # reads one flag back
    return first_repeat(flat, num_rows) < 0


def _checked(flat: np.ndarray, store: Any, sorted_: bool) -> Any:
    """Ids already range-checked here, as a host table takes them without a second check
    (``sorted_``: whether they are sorted, known from the checking pass, so the table
    makes no sortedness pass of its own)."""
    if not isinstance(store, _HostStore):
        return flat
    host = np.ascontiguousarray(flat, dtype=np.int64)
    return IndexBatch(host=host, is_sorted=sorted_, checked_rows=store.num_rows)


def _device_ids(indexes: Any, num_rows: int, check: bool = True) -> Optional[torch.Tensor]:
    """Ids that live on a CUDA device (a CUDA tensor, a CuPy array or any object with
    ``__cuda_array_interface__``) as an int64 torch tensor there, range-checked unless
    ``check`` is False (:func:`_check_device_range`), or ``None`` for host ids.

    Raises:
        IndexError: an id out of range. TypeError: non-integer ids.
    """
    if isinstance(indexes, torch.Tensor):
        if indexes.device.type != "cuda":
            return None
        t = indexes.detach()
    elif hasattr(indexes, "__cuda_array_interface__"):
        t = torch.as_tensor(indexes)  # zero-copy view of the CuPy (or other) array
    else:
        return None
    _check_tensor_dtype(t)
    t = t.to(torch.int64)
    if check:
        _check_device_range(t, num_rows)
    return t


def _check_device_range(t: torch.Tensor, num_rows: int) -> None:
    """Range-check int64 ids on their device: one min/max reduction and one read-back of
    two numbers (a wait on the current stream). Only when it fails are the ids copied to
    the host, to name the first bad id and its position as everywhere in stpipe.

    Raises:
        IndexError: an id out of range.
    """
    flat = t.reshape(-1)
    if flat.numel():
        lo, hi = torch.stack(torch.aminmax(flat)).tolist()
        if lo < 0 or hi >= num_rows:
            check_ids(flat.cpu().numpy(), num_rows)  # raises, naming the first bad id


def _last_wins() -> Any:
    """The CuPy backend (its ``scatter_last`` kernels) where CuPy loads, else None (the
    torch-op twin in :meth:`_TensorStore.scatter_last` runs): the core's shared answer,
    asked once per process (:func:`stpipe.host._cupy_backend`)."""
    from ..host import _cupy_backend

    return _cupy_backend()


def _gadget_ids(indexes: Any, num_rows: int) -> Tuple[np.ndarray, int]:
    """CuPy-style indexes (array, list, tensor, int, slice) → ``(checked ids of their
    shape, order)``; ``order`` as :func:`stpipe.planner.scan_ids` gives it (2: strictly
    increasing, 1: non-decreasing, 0: neither), found in the checking pass."""
    if isinstance(indexes, slice):
        start, stop, step = indexes.indices(num_rows)
        arr = np.arange(start, stop, step, dtype=np.int64)
        return arr, (2 if arr.shape[0] < 2 or step > 0 else 0)
    return scan_ids(indexes, num_rows)


class DataGadget:
    """SpeedTorch's table loaded from a ``.npy`` file, for moving rows to/from the GPU.

    Args:
        fileName: the ``.npy`` file (any float dtype; rows may have several dimensions).
        CPUPinn: keep the table in pinned host memory (a HostTable for 2-d float32/float16
            files) instead of GPU memory.

    Rows come back on the current CUDA device, or on the CPU where CUDA is missing
    (SpeedTorch required CUDA).
    """

    _cupy_named = True

    def __init__(self, fileName: PathLike, CPUPinn: bool = False) -> None:
        self.fileName = fileName
        self.CPUPinn = CPUPinn
        self._where = _placement(on_gpu=not CPUPinn, pin=bool(CPUPinn), cupy_named=True,
                                 what=type(self).__name__)
        self._store: Optional[Union[_TensorStore, _HostStore]] = None
        self._shape: Tuple[int, ...] = ()

    @staticmethod
    def _device() -> torch.device:
        return _cuda_device() if _cuda.cuda_available() else torch.device("cpu")

    def _require(self) -> Union[_TensorStore, _HostStore]:
        if self._store is None:
            raise StpipeRuntimeError("DataGadget: call gadgetInit() (or loadCupy()) first")
        return self._store

    def gadgetInit(self) -> None:
        """Load :attr:`fileName` (never unpickles).

        Raises:
            ValueError: not a ``.npy`` array, or one that needs unpickling.
        """
        self.loadCupy(self.fileName)

    def loadCupy(self, loadFileName: PathLike) -> None:
        """Replace the table with a ``.npy`` file (any shape)."""
        store, shape = _load_store(loadFileName, self._where, self._device())
        if self._store is not None:
            self._store.close()
        self._store, self._shape = store, shape

    def getData(self, indexes: Any) -> torch.Tensor:
        """Rows ``indexes`` (array/list/tensor of any shape, an int or a slice) as a tensor
        of shape ``indexes.shape + row_shape`` on the current CUDA device (CPU without
        CUDA), in the order asked (a repeated id is read again, as a read has no conflict).

        Streams: runs on the current stream; no device-wide sync.

        Raises:
            IndexError: an id out of range. TypeError: non-integer ids.
        """
        store = self._require()
        ids, dev_ids, order = self._ids(indexes, store)
        if ids is None:  # GPU ids: checked there, one gather, no host round trip
            flat_dev = dev_ids.reshape(-1)
            rows = (store.t.index_select(0, flat_dev) if isinstance(store, _TensorStore)
                    else store.table._gather_device(flat_dev))
            return rows.view(tuple(dev_ids.shape) + self._shape[1:])
        flat = ids.reshape(-1).astype(np.int64, copy=False)
        rows = store.gather(_checked(flat, store, order > 0), self._device())
        return rows.view(tuple(ids.shape) + self._shape[1:])

    def insertData(self, dataObject: Any, indexes: Any) -> None:
        """Write ``dataObject`` (a tensor of shape ``indexes.shape + row_shape`` or
        ``(n, *row_shape)``, any device) into rows ``indexes``. Where an id repeats, its
        last occurrence is written, once (SpeedTorch kept one at random).

        Streams: reads ``dataObject`` on the current stream of its device. A pinned
        table with CuPy resolves repeats on the GPU (a sort of the ids, then one UVA
        write; GPU ids are range-checked there with one read-back and never copied to
        the host); without CuPy they are found on the host (nothing waits on the
        device). A GPU-resident table resolves them on the GPU (rows of 32 bytes or more; narrower
        rows sort the ids there and read one flag back, a wait on the current stream,
        not the device): with CuPy, two kernels that also range-check GPU ids, so the
        only wait is one flag read after the write (none for host ids, checked on the
        host); without CuPy, torch ops after a device min/max check of GPU ids.

        Raises:
            IndexError: an id out of range. ValueError: a shape that does not fit.
        """
        store = self._require()
        # a GPU table whose kernels range-check the ids takes GPU ids unchecked (the
        # check then costs no separate pass or wait before the write)
        in_kernel = isinstance(store, _TensorStore) and store.stamps_fit() and store.checks_in_kernel()
        ids, dev_ids, order = self._ids(indexes, store, check=not in_kernel)
        shape = tuple(dev_ids.shape) if ids is None else ids.shape
        if not isinstance(dataObject, torch.Tensor):
            dataObject = (torch.from_dlpack(dataObject) if hasattr(dataObject, "__dlpack__")
                          else torch.as_tensor(np.asarray(dataObject)))
        n = int(np.prod(shape, dtype=np.int64))
        row_shape = tuple(self._shape[1:])
        want, flat_want, got = tuple(shape) + row_shape, (n,) + row_shape, tuple(dataObject.shape)
        if got != want and got != flat_want:
            # the element count alone is not enough: (3, 4) data for 4 rows of 3 would
            # be read as other rows (SpeedTorch's CuPy assignment refused it too)
            alt = "" if want == flat_want else f" or {flat_want}"
            raise StpipeValueError(
                f"insertData: expected data of shape {want}{alt} (the ids' shape "
                f"{tuple(shape)} + the table's row shape {row_shape}), got {got}; "
                "nothing was written"
            )
        rows = dataObject.reshape(n, store.dim)
        if rows.dtype != store.dtype:
            rows = rows.to(store.dtype)
        ids_dev = None
        # ids strictly increasing (found by the checking pass; GPU ids: not asked yet)
        increasing: Optional[bool] = None if ids is None else order == 2
        if isinstance(store, _TensorStore) and store.device.type == "cuda":
            ids_dev = (dev_ids.reshape(-1) if ids is None
                       else _ids_tensor(ids.reshape(-1).astype(np.int64, copy=False), store.device))
            if store.stamps_fit():  # last occurrence wins, decided on the GPU
                store.scatter_last(ids_dev, rows, checked=ids is not None or not in_kernel)
                return
        elif isinstance(store, _HostStore) and (ids is None or store.takes_device_ids(store.device)):
            # a pinned table with UVA kernels: repeats resolved on the GPU by a sort (no
            # host pass over the ids, no sync); ids already sorted and distinct skip it
            flat = None if ids is None else ids.reshape(-1).astype(np.int64, copy=False)
            if flat is None or not increasing:
                ids_dev = dev_ids.reshape(-1) if flat is None else _ids_tensor(flat, store.device)
                rows = rows.detach().to(device=store.device, dtype=store.dtype)
                if store.table._scatter_last(ids_dev, rows):
                    store.version += 1
                    return
        if ids is None:  # narrow rows: the repeat check below also reads the ids on the host
            ids, order = scan_ids(dev_ids.cpu().numpy(), store.num_rows)
            increasing = order == 2
        flat = ids.reshape(-1).astype(np.int64, copy=False)
        if increasing or _distinct(flat, store.num_rows, ids_dev):
            # distinct ids are sorted exactly when strictly increasing
            store.scatter(_checked(flat, store, increasing), rows, ids_dev)
        else:
            _Layout(flat, store.num_rows, dedup=False).scatter(store, rows)

    def saveCupy(self, saveFileName: PathLike) -> None:
        """Save the table as ``.npy`` (``.npy`` appended if missing), atomically."""
        _save_store_npy(self._require(), _npy_name(saveFileName), self._shape)

    @staticmethod
    def _ids(indexes: Any, store: Any, check: bool = True
             ) -> Tuple[Optional[np.ndarray], Optional[torch.Tensor], int]:
        """``(None, ids on the GPU, -1)`` when they are on the GPU table's own device,
        else ``(host ids, None, order)`` (GPU ids for a host table are copied down;
        ``order`` as :func:`_gadget_ids`). All checked, except GPU ids on the table's
        device when ``check`` is False."""
        dev_ids = _device_ids(indexes, store.num_rows, check=False)
        if dev_ids is None:
            ids, order = _gadget_ids(indexes, store.num_rows)
            return ids, None, order
        if (store.device == dev_ids.device if isinstance(store, _TensorStore)
                else store.takes_device_ids(dev_ids.device)):
            if check or not isinstance(store, _TensorStore):
                _check_device_range(dev_ids, store.num_rows)
            return None, dev_ids, -1
        ids, order = scan_ids(dev_ids.cpu().numpy(), store.num_rows)
        return ids, None, order

    def getNumpyVersion(self) -> np.ndarray:
        """A numpy copy of the table, in the file's shape."""
        return self._require().numpy().reshape(self._shape)

    def close(self) -> None:
        """Free the table."""
        if self._store is not None:
            self._store.close()
            self._store = None


# ---------------------------------------------------------------------------------------
# the memory-mapped variants
# ---------------------------------------------------------------------------------------
class ModelFactoryMM(ModelFactory):
    """SpeedTorch's memory-mapped :class:`ModelFactory`: the same switcher with one more
    argument, ``diskname``. SpeedTorch made the table through a ``.npy`` memmap named
    after it and then held it with CuPy (in GPU memory, or in pinned host memory with
    ``CPUPinn=True``); here the table is made directly, as :class:`ModelFactory` makes it,
    and no file is written. ``diskname`` is kept as :attr:`diskname`.
    """

    def __init__(self, model_variable: Any, total_classes: int, embed_dimension: int,
                 diskname: str = "variable", datatype: Any = "float32", CPUPinn: bool = False,
                 *, dedup: bool = True) -> None:
        super().__init__(model_variable, total_classes, embed_dimension, datatype, CPUPinn, dedup=dedup)
        self.diskname = diskname


class OptimizerFactoryMM(OptimizerFactory):
    """SpeedTorch's memory-mapped :class:`OptimizerFactory` (same arguments): here it is
    :class:`OptimizerFactory`, its state tables made directly (no file). SpeedTorch
    0.1.6's own fails on PyTorch 2.x as its ``OptimizerFactory`` does (int ``step``)."""


class DataGadgetMM(DataGadget):
    """SpeedTorch's memory-mapped :class:`DataGadget` (same arguments; SpeedTorch 0.1.6's
    own raised at construction). Its :meth:`getData` takes the switchers' pair of ids;
    :meth:`insertData` and the files work as in :class:`DataGadget`."""

    def getData(self, retrievedPosIndexes: Any, retrievedNegIndexes: Any = None) -> torch.Tensor:  # type: ignore[override]
        """Rows of ``retrievedPosIndexes`` flattened, then ``retrievedNegIndexes``
        flattened (when given), as ``(n, *row_shape)``; see :meth:`DataGadget.getData`."""
        if retrievedNegIndexes is None:  # any ids DataGadget takes (GPU ids stay there)
            return super().getData(retrievedPosIndexes).reshape((-1,) + self._shape[1:])
        self._require()  # no table: that error first, as in DataGadget.getData
        return super().getData(_flat_ids(retrievedPosIndexes, retrievedNegIndexes))


# ---------------------------------------------------------------------------------------
# SpeedTorch names not carried over
# ---------------------------------------------------------------------------------------
_COM = ("SpeedTorch's {name} (a helper holding a total_classes x total_classes matrix of "
        "zeros, for co-occurrence counts) is not carried over; make the matrix with "
        "torch.zeros(...) on the device you need")
_ALLOC = ("SpeedTorch's {name} swapped CuPy's allocator globally to pin a table (not "
          "thread-safe; twice the table's size in host RAM); stpipe does not: CPUPinn=True "
          "page-locks a table in place at its exact size")
#: SpeedTorch 0.1.6 exports that this module does not offer -> why, and what to use
_NOT_CARRIED: Dict[str, str] = {
    **{n: _COM.format(name=n) for n in ("COM", "COMMM", "PytorchCOM", "GPUPytorchCOM", "CPUPytorchCOM")},
    **{n: _ALLOC.format(name=n) for n in ("PMemory", "PMemoryMM", "my_pinned_allocator",
                                           "my_pinned_allocatorMM")},
}


def __getattr__(name: str) -> Any:
    """A clear error for SpeedTorch names this module does not carry over."""
    why = _NOT_CARRIED.get(name)
    if why is not None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}: {why}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

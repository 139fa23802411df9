"""Checkpoints: host tables, per-row optimizer state and scalar state, saved and resumed exactly.

::

    stpipe.checkpoint.save("ckpt/step-1000", pipe, extra={"step": 1000, "model": model.state_dict()})
    ...
    pipe = stpipe.Pipeline(emb, optimizer=opt, ids="ids")      # fresh objects, same shapes
    extra = stpipe.checkpoint.load("ckpt/step-1000", pipe)     # or pipe.load_checkpoint(path)

A run stopped after step ``k`` (even with batches gathered ahead, in flight) and resumed
from its checkpoint ends bit-identical to the uninterrupted run: tables, per-row state
tables, the optimizer's scalar state (``step``, ...) and hyper-parameters (``lr`` after a
scheduler) are restored exactly. Saving waits for every write-back issued so far
(:meth:`Pipeline.synchronize <stpipe.Pipeline.synchronize>`); it refuses to run inside a
step. Rows of batches in flight are not saved: they are not trained yet, and the host
tables already hold every finished step's rows.

Layout. A checkpoint is a directory::

    path/
      manifest.json          the small part: format, shapes, dtypes, optimizer classes and
                             hyper-parameters, scalar state, stats, ``extra``, and for every
                             file its size and CRC-32s (of the header and of each 64 MiB
                             chunk, computed on a few threads while the file streams)
      000-tables.0.weight.npy, 001-tables.0.row_state.tables.exp_avg.npy, ...

Every tensor with more than 64 elements is a ``.npy`` file (bfloat16 as its raw bits,
``<u2``); small ones (``step``) are inline in the manifest, exactly (JSON floats round-trip).
Tables are streamed to disk 64 MiB at a time straight from the host table, with the CRC
computed chunk by chunk: no second full-size copy in RAM.

Files are data, never code (semantics 7). The manifest is read with ``json``; ``.npy``
headers are parsed and checked against the manifest (dtype, shape, C order, file size)
and the data is read with ``readinto``/``frombuffer``: nothing is ever unpickled, and a
file holding Python objects is refused. :func:`load` refuses, with
:class:`~stpipe.StpipeValueError` and before touching any table, a checkpoint whose
tables have other names, shapes or dtypes, whose optimizers are of another class or have
other parameter groups, a missing or truncated file, a file that does not match its
manifest and, with ``verify="first"`` (the default), a checksum mismatch.

Atomic writes and the recovery rule. :func:`save` writes everything into a fresh
``<path>.tmp-XXXX`` directory next to the target (each file and the directory fsynced, the
manifest last), then: if ``path`` exists, renames it to ``<path>.old``, renames the new
directory to ``path`` and deletes ``<path>.old`` (renamed to ``<path>.trash-XXXX`` first);
otherwise renames the new one in. A directory is named ``path`` or ``<path>.old`` only
when complete, so a crash at any point leaves a loadable checkpoint:

* :func:`load` reads ``path`` when it holds a manifest, else falls back to ``<path>.old``
  (with a ``RuntimeWarning``): that happens only after a crash between the two renames.
* ``<path>.tmp-*`` and ``<path>.trash-*`` are garbage; the next :func:`save` removes them.
  One writer per path at a time.
* A save that lands while another process loads the same path does not mix the two
  checkpoints: the files read into the tables stay open from their check to their read
  (the other files are read into new memory, checksummed, before any table is written).
  The load gets the checkpoint whose manifest it read, or refuses with a checksum
  mismatch and leaves the targets untouched.

``save`` refuses to replace an existing ``path`` that is not an stpipe checkpoint.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import secrets
import shutil
import tempfile
import time
import warnings
import zlib
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ._io import NpyHeaderError, fsync_folder, read_npy_header
from ._errors import StpipeRuntimeError, StpipeTypeError, StpipeValueError

__all__ = ["save", "load", "state_dict", "load_state_dict", "read_manifest", "FORMAT", "VERSION"]

FORMAT = "stpipe-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
#: Bytes per chunk of file I/O and checksumming (the manifest records it per file).
_CHUNK = 64 << 20
#: Threads computing CRCs while the calling thread reads or writes (zlib releases the GIL).
_CRC_THREADS = max(1, min(4, os.cpu_count() or 1))
#: Buffers smaller than this are checksummed on the calling thread.
_CRC_INLINE = 1 << 20
#: Tensors with at most this many elements (real, finite) are stored in the manifest.
_INLINE_MAX = 64
#: A manifest larger than this is refused (it holds metadata only).
_MANIFEST_MAX = 256 << 20

PathLike = Union[str, "os.PathLike[str]"]

# torch dtype -> (.npy descr, name); bfloat16 is stored as its raw bits
_DTYPES: Dict[torch.dtype, Tuple[str, str]] = {
    torch.float32: ("<f4", "float32"),
    torch.float64: ("<f8", "float64"),
    torch.float16: ("<f2", "float16"),
    torch.bfloat16: ("<u2", "bfloat16"),
    torch.int64: ("<i8", "int64"),
    torch.int32: ("<i4", "int32"),
    torch.int16: ("<i2", "int16"),
    torch.int8: ("|i1", "int8"),
    torch.uint8: ("|u1", "uint8"),
    torch.bool: ("|b1", "bool"),
    torch.complex64: ("<c8", "complex64"),
    torch.complex128: ("<c16", "complex128"),
}
_BY_NAME = {name: dt for dt, (_, name) in _DTYPES.items()}


def _crash_point(name: str) -> None:
    """No-op; the crash tests replace it to kill the process between the steps of a save."""


def _dtype_name(dt: torch.dtype) -> str:
    try:
        return _DTYPES[dt][1]
    except KeyError:
        raise StpipeTypeError(f"cannot store a tensor of dtype {dt} in a checkpoint") from None


def _dtype_of(name: Any, where: str) -> torch.dtype:
    dt = _BY_NAME.get(name) if isinstance(name, str) else None
    if dt is None:
        raise StpipeValueError(f"{where}: unknown dtype {name!r} in the manifest; expected one of {sorted(_BY_NAME)}")
    return dt


# =============================================================================== targets
class _Targets:
    """What a checkpoint is saved from or loaded into: tables, optimizers, the pipeline."""

    def __init__(self, obj: Any, optimizer: Any, *, bind: bool) -> None:
        from .embedding import HostEmbedding
        from .pipeline import Pipeline

        self.pipeline: Optional[Pipeline] = None
        opts = _as_optimizers(optimizer)
        if isinstance(obj, Pipeline):
            self.pipeline = obj
            self.tables: Dict[Any, HostEmbedding] = dict(obj.tables)
            own = list(obj._optimizers)
            if opts is not None and {id(o) for o in opts} != {id(o) for o in own}:
                raise StpipeValueError(
                    "optimizer= differs from the pipeline's optimizers; leave it out when passing a Pipeline"
                )
            self.optimizers = own
        else:
            if isinstance(obj, HostEmbedding):
                self.tables = {None: obj}
            elif isinstance(obj, Mapping):
                self.tables = dict(obj)
            elif isinstance(obj, (list, tuple)):
                self.tables = dict(enumerate(obj))
            else:
                raise StpipeTypeError(
                    "expected a Pipeline, a HostEmbedding, or a dict/list of HostEmbeddings, "
                    f"got {type(obj).__name__}"
                )
            if not self.tables:
                raise StpipeValueError("no tables given")
            for name, emb in self.tables.items():
                if not isinstance(emb, HostEmbedding):
                    raise StpipeTypeError(f"table {name!r} must be a HostEmbedding, got {type(emb).__name__}")
            if opts is None:  # the optimizers bound to the tables (by a pipeline)
                opts = []
                for emb in self.tables.values():
                    rs = emb.row_state
                    if rs is not None and all(o is not rs.optimizer for o in opts):
                        opts.append(rs.optimizer)
            self.optimizers = opts
            if bind:
                for name, emb in self.tables.items():
                    owner = _owner(self.optimizers, emb.weight)
                    if owner is not None:
                        emb.bind_optimizer(owner)
        for name in self.tables:
            if not (name is None or isinstance(name, str) or (isinstance(name, int) and not isinstance(name, bool))):
                raise StpipeTypeError(f"table names must be str, int or None to be saved, got {name!r}")

    def check_between_steps(self, what: str) -> None:
        for name, emb in self.tables.items():
            if emb._binding is not None:
                raise StpipeRuntimeError(
                    f"{what} inside a step (table {name!r} is bound to a step): the step's rows "
                    "are not written back yet; call it between steps (after `with step:` ends)"
                )

    def synchronize(self) -> None:
        """Wait for every write-back issued so far (the pipeline's copy stream, table events)."""
        if self.pipeline is not None:
            self.pipeline.synchronize()
        for emb in self.tables.values():
            for t in [emb.table, *emb.state_tables.values()]:
                t.synchronize()

    def where(self, emb: Any) -> Tuple[Optional[int], Optional[int]]:
        """(optimizer index, param index) of ``emb.weight`` among the optimizers."""
        for oi, opt in enumerate(self.optimizers):
            for pi, p in enumerate(_params(opt)):
                if p is emb.weight:
                    return oi, pi
        return None, None


def _as_optimizers(optimizer: Any) -> Optional[List[torch.optim.Optimizer]]:
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    if isinstance(optimizer, (list, tuple)) and all(isinstance(o, torch.optim.Optimizer) for o in optimizer):
        return list(optimizer)
    raise StpipeTypeError(
        f"optimizer must be a torch.optim.Optimizer, a list of them or None, got {type(optimizer).__name__}"
    )


def _owner(opts: Sequence[torch.optim.Optimizer], param: torch.Tensor) -> Optional[torch.optim.Optimizer]:
    for opt in opts:
        if any(p is param for p in _params(opt)):
            return opt
    return None


def _params(opt: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _class_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


# ============================================================================ state dict
def state_dict(obj: Any, optimizer: Any = None) -> Dict[str, Any]:
    """The checkpoint state of a pipeline or of tables (+ optimizers), as a nested dict.

    Waits for every write-back issued so far first. Like ``nn.Module.state_dict`` the
    tables are *views* of the host tables (no copy; they change as training goes on: save
    or copy them first); scalar and dense optimizer state is copied. The dict holds only
    tensors, str, int, float, bool, None, lists, tuples and dicts, so
    ``torch.save``/``torch.load(weights_only=True)`` round-trip it.

    Args:
        obj: a :class:`~stpipe.Pipeline`, a :class:`~stpipe.HostEmbedding`, or a dict/list
            of them.
        optimizer: the optimizer(s) of the tables; default: the pipeline's, or those bound
            to the tables.

    Returns:
        ``{"format", "version", "tables": [...], "optimizers": [...], "stats"}``.

    Raises:
        StpipeRuntimeError: called inside a step.
        StpipeTypeError: bad arguments or table names other than str/int/None.
    """
    tg = _Targets(obj, optimizer, bind=False)
    tg.check_between_steps("state_dict() called")
    tg.synchronize()
    tables = []
    for name, emb in tg.tables.items():
        oi, pi = tg.where(emb)
        rs = emb.row_state
        row_state = None
        if rs is not None and oi is not None and rs.optimizer is tg.optimizers[oi]:
            row_state = {
                "discovered": bool(rs.discovered),
                "keys": list(rs.keys),
                "scalar_keys": list(rs.scalar_keys),
                "tables": {key: rs.tables[key].tensor() for key in rs.keys},
            }
        tables.append({
            "name": name,
            "num_rows": emb.num_rows,
            "dim": emb.embedding_dim,
            "dtype": _dtype_name(emb.dtype),
            "weight": emb.table.tensor(),
            "optimizer": oi,
            "param": pi,
            "row_state": row_state,
        })
    per_row = {}  # (optimizer index, param index) -> keys held in host tables
    for t in tables:
        if t["row_state"] is not None and t["row_state"]["discovered"]:
            per_row[(t["optimizer"], t["param"])] = set(t["row_state"]["keys"])
    optimizers = []
    for oi, opt in enumerate(tg.optimizers):
        groups, index = [], 0
        for g in opt.param_groups:
            hyper = {k: _copy_value(v) for k, v in g.items() if k != "params"}
            hyper["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(hyper)
        state = {}
        for pi, p in enumerate(_params(opt)):
            st = opt.state.get(p)
            if not st:
                continue
            skip = per_row.get((oi, pi), set())
            state[pi] = {k: _copy_value(v) for k, v in st.items() if k not in skip}
        optimizers.append({"class": _class_name(opt), "param_groups": groups, "state": state})
    stats = dict(tg.pipeline.stats) if tg.pipeline is not None else None
    return {"format": FORMAT, "version": VERSION, "tables": tables, "optimizers": optimizers, "stats": stats}


def _copy_value(v: Any) -> Any:
    if torch.is_tensor(v):
        return v.detach().clone()
    if isinstance(v, (list, tuple)):
        return type(v)(_copy_value(x) for x in v) if not hasattr(v, "_fields") else v
    if isinstance(v, dict):
        return {k: _copy_value(x) for k, x in v.items()}
    return v


# ================================================================== sources of tensors
class _Inline:
    """A small tensor stored in the manifest."""

    def __init__(self, meta: Mapping[str, Any], where: str) -> None:
        self.where = where
        self.dtype = _dtype_of(meta.get("dtype"), where)
        self.shape = _shape_of(meta.get("shape"), where)
        self.device = str(meta.get("device", "cpu"))
        data = meta.get("data")
        n = math.prod(self.shape)
        if not isinstance(data, list) or len(data) != n or not all(isinstance(x, (int, float)) for x in data):
            raise StpipeValueError(f"{where}: inline tensor data does not match its shape {self.shape}")
        self.data = data

    def spec(self) -> Tuple[Tuple[int, ...], torch.dtype]:
        return self.shape, self.dtype

    def tensor(self) -> torch.Tensor:
        return torch.tensor(self.data, dtype=self.dtype).reshape(self.shape)


class _FileRef:
    """A tensor stored as a ``.npy`` file of the checkpoint, checked against the manifest."""

    def __init__(self, folder: str, meta: Mapping[str, Any], files: Mapping[str, Any], where: str) -> None:
        self.where = where
        name = meta.get("file")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+\.npy", name) or name.startswith("."):
            raise StpipeValueError(f"{where}: bad file name {name!r} in the manifest")
        info = files.get(name)
        crcs = info.get("crc32") if isinstance(info, Mapping) else None
        if (not isinstance(info, Mapping) or not isinstance(info.get("bytes"), int)
                or not isinstance(info.get("chunk"), int) or not 0 < info["chunk"] <= (1 << 30)
                or not isinstance(crcs, list) or not all(isinstance(c, int) for c in crcs)):
            raise StpipeValueError(f"{where}: file {name!r} has no size/checksum entry in the manifest")
        self.name = name
        self.path = os.path.join(folder, name)
        self.dtype = _dtype_of(meta.get("dtype"), where)
        self.shape = _shape_of(meta.get("shape"), where)
        self.device = str(meta.get("device", "cpu"))
        self.size = int(info["bytes"])
        self.crcs = [int(c) for c in info["crc32"]]
        self.chunk = int(info["chunk"])
        self.offset: Optional[int] = None
        self._held: Optional[BinaryIO] = None  # open since ``check_header(hold=True)``

    def spec(self) -> Tuple[Tuple[int, ...], torch.dtype]:
        return self.shape, self.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def check_header(self, hold: bool = False) -> None:
        """Open the file, parse and check its header and size (no data read).

        With ``hold``, the file stays open and every later read (:meth:`verify`,
        :meth:`read_into`) goes through it, so they all read the file that was checked,
        even if a save to the same path moves another checkpoint in meanwhile (the old
        files stay readable while open); :meth:`release` closes it.

        Raises:
            StpipeValueError: missing file, not ``.npy``, a pickled/object array, a dtype,
                shape or order other than the manifest's, or a size other than the
                manifest's (truncated or extended).
        """
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            raise StpipeValueError(f"{self.path}: file missing; the checkpoint is incomplete") from None
        try:
            try:
                shape, fortran, dt, offset = read_npy_header(f)
            except NpyHeaderError as exc:
                raise StpipeValueError(
                    f"{self.path}: not a valid .npy file ({exc}); the checkpoint is corrupted"
                ) from None
            if dt.hasobject:
                raise StpipeValueError(
                    f"{self.path} holds Python objects, which need unpickling; stpipe refuses "
                    "pickled data (files are data, never code)"
                )
            want_descr = _DTYPES[self.dtype][0]
            if dt.str != want_descr or dt.names is not None:
                raise StpipeValueError(
                    f"{self.path}: dtype {dt.str} does not match the manifest's {_dtype_name(self.dtype)} ({want_descr})"
                )
            if tuple(shape) != self.shape:
                raise StpipeValueError(f"{self.path}: shape {tuple(shape)} does not match the manifest's {self.shape}")
            if fortran and len(shape) > 1 and min(shape) > 1:
                raise StpipeValueError(f"{self.path}: fortran order; expected C order")
            self.offset = offset
            size = os.fstat(f.fileno()).st_size
        except BaseException:
            f.close()
            raise
        if hold:
            self.release()
            self._held = f
        else:
            f.close()
        want = self.offset + self.nbytes
        if size != want or size != self.size:
            raise StpipeValueError(
                f"{self.path}: {size} bytes, expected {want} ({self.offset} header + {self.nbytes} data; "
                f"manifest says {self.size}); the file is truncated or corrupted"
            )

    def release(self) -> None:
        """Close the file kept open by ``check_header(hold=True)`` (if any)."""
        f, self._held = self._held, None
        if f is not None:
            f.close()

    @contextlib.contextmanager
    def _open(self) -> Iterator[BinaryIO]:
        """The held file from its start, or the file opened by path (closed after)."""
        if self._held is not None:
            self._held.seek(0)
            yield self._held
            return
        with open(self.path, "rb") as f:
            yield f

    def _check_crcs(self, got: List[int]) -> None:
        if got != self.crcs:
            bad = next((i for i, (a, b) in enumerate(zip(got, self.crcs)) if a != b), min(len(got), len(self.crcs)))
            what = "header" if bad == 0 else f"data chunk {bad - 1} (bytes from {(bad - 1) * self.chunk})"
            raise StpipeValueError(
                f"{self.path}: checksum mismatch in the {what}; the file is corrupted"
            )

    def verify(self, ring: Optional[List[np.ndarray]] = None) -> None:
        """Read the whole file and compare its CRC-32s (header, then each chunk) with the manifest's.

        Reads into a ring of buffers on this thread (``ring``, reused across files, or
        new ones) while :data:`_CRC_THREADS` threads checksum the chunks already read.
        """
        if self.offset is None:
            self.check_header()
        crcs = _Crcs()
        size = max(1, min(self.chunk, self.nbytes))
        if ring is None or len(ring[0]) < size:
            ring = _ring(size)
        with self._open() as f:
            crcs.add(f.read(self.offset))
            busy: List[Optional[Future]] = [None] * len(ring)
            i = 0
            while True:
                j = i % len(ring)
                if busy[j] is not None:
                    busy[j].result()  # that buffer's checksum is done: reuse it
                mv = memoryview(ring[j])[:size]
                got = _read_full(f, mv)
                if not got:
                    break
                busy[j] = crcs.add(mv[:got])
                i += 1
        self._check_crcs(crcs.result())

    def read_into(self, dest: torch.Tensor) -> None:
        """Stream the data into ``dest`` (contiguous CPU, the file's shape and dtype), checking the CRCs.

        The calling thread reads chunk after chunk straight into ``dest``
        (``readinto``); :data:`_CRC_THREADS` threads checksum the chunks already read.

        Raises:
            StpipeValueError: a short read or a checksum mismatch (``dest`` is then
                partially overwritten).
        """
        if self.offset is None:
            self.check_header()
        flat = memoryview(_bytes_of(dest))
        crcs = _Crcs()
        with self._open() as f:
            crcs.add(f.read(self.offset))
            for start in range(0, len(flat), self.chunk):
                piece = flat[start:start + self.chunk]
                if _read_full(f, piece) != len(piece):
                    raise StpipeValueError(f"{self.path} ended inside chunk {start // self.chunk}; the file is truncated")
                crcs.add(piece)
            if f.read(1):
                raise StpipeValueError(f"{self.path} is longer than its header says; the file is corrupted")
        self._check_crcs(crcs.result())

    def tensor(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        self.read_into(out)
        return out


def _shape_of(shape: Any, where: str) -> Tuple[int, ...]:
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise StpipeValueError(f"{where}: bad shape {shape!r} in the manifest")
    return tuple(shape)


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat uint8 numpy array (shares memory)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise StpipeValueError("expected a contiguous CPU tensor")
    if t.numel() == 0:
        return np.empty(0, np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def _spec(v: Any) -> Optional[Tuple[Tuple[int, ...], torch.dtype]]:
    if torch.is_tensor(v):
        return tuple(v.shape), v.dtype
    if isinstance(v, (_Inline, _FileRef)):
        return v.spec()
    return None


def _fill(dest: torch.Tensor, src: Any) -> None:
    """Copy ``src`` (a tensor or a stored one) into ``dest`` (a contiguous CPU tensor)."""
    if isinstance(src, _FileRef):
        src.read_into(dest)
        return
    t = src.tensor() if isinstance(src, _Inline) else src.detach()
    if dest.dim() == 0 or dest.shape[0] == 0:
        dest.copy_(t)
        return
    rows = max(1, _CHUNK // max(1, dest[0].numel() * dest.element_size()))
    for a in range(0, dest.shape[0], rows):
        dest[a:a + rows].copy_(t[a:a + rows])


def _materialize(v: Any, device: Optional[torch.device]) -> Any:
    """Decoded value -> Python value with real tensors (placed on ``device`` if saved off-CPU)."""
    if isinstance(v, (_Inline, _FileRef)):
        t = v.tensor()
        return t.to(device) if device is not None and v.device != "cpu" else t
    if torch.is_tensor(v):
        t = v.detach().clone()
        if device is not None and v.device.type != "cpu":
            return t.to(device)
        return t.cpu()
    if isinstance(v, tuple) and not hasattr(v, "_fields"):
        return tuple(_materialize(x, device) for x in v)
    if isinstance(v, list):
        return [_materialize(x, device) for x in v]
    if isinstance(v, dict):
        return {k: _materialize(x, device) for k, x in v.items()}
    return v


def _refs(v: Any) -> Iterator[_FileRef]:
    if isinstance(v, _FileRef):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _refs(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from _refs(x)


# ====================================================================== check and apply
def _get(m: Any, key: str, kind: Any, where: str) -> Any:
    if not isinstance(m, Mapping) or key not in m or not isinstance(m[key], kind):
        raise StpipeValueError(f"{where}: missing or malformed {key!r}; not an stpipe checkpoint (or a damaged one)")
    return m[key]


def _check(tg: _Targets, sd: Mapping[str, Any]) -> bool:
    """Validate ``sd`` against the targets before anything is written.

    Returns:
        True when the optimizer state is to be loaded, False for tables only (tables
        given without any optimizer).
    """
    if not isinstance(sd, Mapping) or sd.get("format") != FORMAT:
        raise StpipeValueError(f"not an stpipe checkpoint state (format {sd.get('format') if isinstance(sd, Mapping) else type(sd).__name__!r}, expected {FORMAT!r})")
    if sd.get("version") != VERSION:
        raise StpipeValueError(f"checkpoint version {sd.get('version')!r} is not supported; expected {VERSION}")
    tables = _get(sd, "tables", list, "checkpoint")
    optimizers = _get(sd, "optimizers", list, "checkpoint")
    by_name = {}
    for i, t in enumerate(tables):
        if not isinstance(t, Mapping) or "name" not in t:
            raise StpipeValueError(f"checkpoint table {i}: malformed entry")
        by_name[t["name"]] = t
    if set(by_name) != set(tg.tables) or len(by_name) != len(tables):
        raise StpipeValueError(
            f"the checkpoint has tables {sorted(map(repr, by_name))}, the target has "
            f"{sorted(map(repr, tg.tables))}; load into the same tables"
        )
    with_opt = bool(tg.optimizers) or tg.pipeline is not None
    if with_opt:
        if len(optimizers) != len(tg.optimizers):
            raise StpipeValueError(
                f"the checkpoint has {len(optimizers)} optimizer(s), the target {len(tg.optimizers)}; "
                "build the same optimizers before loading"
            )
        for oi, (so, opt) in enumerate(zip(optimizers, tg.optimizers)):
            cls = _get(so, "class", str, f"optimizer {oi}")
            if cls != _class_name(opt):
                raise StpipeValueError(
                    f"optimizer {oi}: the checkpoint holds the state of {cls}, got a {_class_name(opt)}; "
                    "build the same optimizer class before loading"
                )
            groups = _get(so, "param_groups", list, f"optimizer {oi}")
            got = [len(g["params"]) for g in opt.param_groups]
            want = [len(_get(g, "params", list, f"optimizer {oi} group")) for g in groups]
            if got != want:
                raise StpipeValueError(
                    f"optimizer {oi} ({cls}): parameter groups of sizes {want} in the checkpoint, {got} here"
                )
            n = sum(got)
            for pi in _get(so, "state", dict, f"optimizer {oi}"):
                if not isinstance(pi, int) or not 0 <= pi < n:
                    raise StpipeValueError(f"optimizer {oi}: state of parameter {pi!r}, which does not exist ({n} parameters)")
    for name, emb in tg.tables.items():
        t = by_name[name]
        where = f"table {name!r}"
        spec = _spec(t.get("weight"))
        want = ((emb.num_rows, emb.embedding_dim), emb.dtype)
        if spec is None:
            raise StpipeValueError(f"{where}: no weight in the checkpoint")
        if spec != want:
            raise StpipeValueError(
                f"{where}: the checkpoint holds a {spec[0]} {_dtype_name(spec[1])} table, the embedding "
                f"is {want[0]} {_dtype_name(want[1])}; build it with the same num_rows, dim and dtype"
            )
        if not with_opt:
            continue
        oi, pi = tg.where(emb)
        if (t.get("optimizer"), t.get("param")) != (oi, pi):
            raise StpipeValueError(
                f"{where}: its weight is parameter {t.get('param')} of optimizer {t.get('optimizer')} in "
                f"the checkpoint, parameter {pi} of optimizer {oi} here"
            )
        rs = t.get("row_state")
        if rs is None:
            continue
        keys = _get(rs, "keys", list, f"{where} row_state")
        st = _get(rs, "tables", dict, f"{where} row_state")
        _get(rs, "scalar_keys", list, f"{where} row_state")
        if set(st) != set(keys):
            raise StpipeValueError(f"{where}: row-state keys {keys} but tables for {sorted(st)}")
        for key in keys:
            spec = _spec(st[key])
            if spec is None or spec[0] != (emb.num_rows, emb.embedding_dim):
                raise StpipeValueError(
                    f"{where}: optimizer state {key!r} of shape {None if spec is None else spec[0]}, "
                    f"expected {(emb.num_rows, emb.embedding_dim)}"
                )
        cur = emb.row_state
        if cur is not None and cur.discovered and rs.get("discovered") and set(cur.keys) != set(keys):
            raise StpipeValueError(
                f"{where}: the checkpoint has optimizer state {keys}, the optimizer here {list(cur.keys)}"
            )
    return with_opt


def _apply(tg: _Targets, sd: Mapping[str, Any], with_opt: bool) -> None:
    """Load checked state into the targets: what goes to new memory (fresh state tables,
    the optimizers' state) is read first; the live tables are written last, from the files
    :func:`load` holds open. Only an I/O error while those stream in (or a checksum
    mismatch, with ``verify="stream"``) leaves the tables partly loaded."""
    from .host import HostTable

    by_name = {t["name"]: t for t in sd["tables"]}
    # phase 1: read what does not overwrite the targets (fresh state tables, small state)
    row_states: Dict[Any, Any] = {}
    inplace: List[Tuple[torch.Tensor, Any]] = []
    fresh: List[Any] = []
    try:
        for name, emb in tg.tables.items():
            rs = by_name[name].get("row_state") if with_opt else None
            if rs is None:
                continue
            cur = emb.row_state
            tables = {}
            for key in rs["keys"]:
                src = rs["tables"][key]
                dtype = _spec(src)[1]
                old = cur.tables.get(key) if cur is not None else None
                if old is not None and old.dtype == dtype and not old.closed:
                    tables[key] = old
                    inplace.append((old.tensor(), src))
                else:
                    t = HostTable(emb.num_rows, emb.embedding_dim, dtype, **emb._table_kwargs)
                    fresh.append(t)
                    _fill(t.tensor(), src)
                    tables[key] = t
            row_states[name] = (bool(rs.get("discovered")), tuple(rs["keys"]), tuple(rs["scalar_keys"]), tables)
        opt_states = []
        if with_opt:
            for so, opt in zip(sd["optimizers"], tg.optimizers):
                params = _params(opt)
                groups = [{k: _materialize(v, None) for k, v in g.items() if k != "params"} for g in so["param_groups"]]
                state = {pi: {k: _materialize(v, params[pi].device) for k, v in st.items()}
                         for pi, st in so["state"].items()}
                opt_states.append((groups, state))
        # phase 2: overwrite the targets
        for name, emb in tg.tables.items():
            _fill(emb.table.tensor(), by_name[name]["weight"])
        for dest, src in inplace:
            _fill(dest, src)
    except BaseException:
        for t in fresh:
            t.close()
        raise
    for name, emb in tg.tables.items():
        if name in row_states:
            emb._restore_row_state(*row_states[name])
        elif with_opt and emb.row_state is not None:
            emb._restore_row_state(False, (), (), {})
    for (groups, state), opt in zip(opt_states, tg.optimizers):
        params = _params(opt)
        for g, saved in zip(opt.param_groups, groups):
            for k, v in saved.items():
                g[k] = v
        opt.state = defaultdict(dict)
        for pi, st in state.items():
            opt.state[params[pi]] = st
    if tg.pipeline is not None:
        tg.pipeline._after_load(sd.get("stats"))


def load_state_dict(obj: Any, sd: Mapping[str, Any], optimizer: Any = None) -> None:
    """Load a :func:`state_dict` into a pipeline or tables (+ optimizers).

    Everything is checked before anything is written (names, shapes, dtypes, optimizer
    classes and parameter groups); then the tables are copied chunk by chunk, the per-row
    state tables created or overwritten, and the optimizer's hyper-parameters and state
    replaced (like ``Optimizer.load_state_dict``; tensors keep their dtype exactly).
    Tables given without any optimizer load the weights only.

    Raises:
        StpipeValueError: a mismatch (nothing is written then).
        StpipeRuntimeError: inside a step, or a pipeline run is active.
    """
    tg = _Targets(obj, optimizer, bind=True)
    _check_loadable(tg)
    with_opt = _check(tg, sd)
    _apply(tg, sd, with_opt)


def _check_loadable(tg: _Targets) -> None:
    tg.check_between_steps("loading a checkpoint")
    p = tg.pipeline
    if p is not None and p._run is not None:
        raise StpipeRuntimeError(
            "loading a checkpoint while a run of the pipeline is active (batches in flight "
            "hold rows read before the load); finish the run or close it first"
        )
    tg.synchronize()


def _ring(size: int) -> List[np.ndarray]:
    """Read buffers for :meth:`_FileRef.verify` (uninitialised: no zeroing pass)."""
    return [np.empty(size, np.uint8) for _ in range(2 * _CRC_THREADS)]


def _read_full(f: Any, mv: memoryview) -> int:
    """``readinto`` until ``mv`` is full or the file ends; returns the bytes read."""
    pos = 0
    while pos < len(mv):
        got = f.readinto(mv[pos:])
        if not got:
            break
        pos += got
    return pos


class _Crcs:
    """CRC-32s of a sequence of buffers, computed on a shared thread pool, in order."""

    _pool: Optional[ThreadPoolExecutor] = None
    _pid = 0

    def __init__(self) -> None:
        if _Crcs._pool is None or _Crcs._pid != os.getpid():  # a forked child has no pool threads
            _Crcs._pool = ThreadPoolExecutor(_CRC_THREADS, thread_name_prefix="stpipe-crc")
            _Crcs._pid = os.getpid()
        self.futures: List[Future] = []

    def add(self, buf: Any) -> Future:
        """Checksum ``buf`` (kept alive and unchanged until its future is done)."""
        if len(buf) < _CRC_INLINE:  # small: not worth a thread hop
            fut: Future = Future()
            fut.set_result(zlib.crc32(buf))
        else:
            fut = _Crcs._pool.submit(zlib.crc32, buf)
        self.futures.append(fut)
        return fut

    def result(self) -> List[int]:
        return [f.result() for f in self.futures]


# ============================================================================ encoding
class _Writer:
    """Encodes a state tree to JSON; tensors go inline or to streamed ``.npy`` files."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.files: Dict[str, Dict[str, int]] = {}

    def encode(self, v: Any, where: str) -> Any:
        if torch.is_tensor(v):
            return {"__tensor__": self.tensor(v, where)}
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            return v
        if isinstance(v, np.generic):
            return self.encode(v.item(), where)
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return {"__tuple__": [self.encode(x, f"{where}.{i}") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [self.encode(x, f"{where}.{i}") for i, x in enumerate(v)]
        if isinstance(v, Mapping):
            if all(isinstance(k, str) and not k.startswith("__") for k in v):
                return {k: self.encode(x, f"{where}.{k}") for k, x in v.items()}
            return {"__items__": [[self.encode(k, where), self.encode(x, f"{where}.{k}")] for k, x in v.items()]}
        raise StpipeTypeError(
            f"{where}: cannot store a {type(v).__name__} in a checkpoint; use tensors, numbers, "
            "str, None, lists, tuples and dicts"
        )

    def tensor(self, t: torch.Tensor, where: str) -> Dict[str, Any]:
        t = t.detach()
        meta = {"dtype": _dtype_name(t.dtype), "shape": list(t.shape), "device": t.device.type}
        if t.numel() <= _INLINE_MAX and not t.is_complex():
            c = t.cpu()
            if not c.is_floating_point() or bool(torch.isfinite(c).all()):
                meta["data"] = c.reshape(-1).tolist()
                return meta
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        name = f"{len(self.files):03d}-" + re.sub(r"[^A-Za-z0-9_.\-]", "_", where)[:80] + ".npy"
        self.files[name] = self._write(os.path.join(self.folder, name), t)
        meta["file"] = name
        _crash_point(f"file:{len(self.files)}")
        return meta

    @staticmethod
    def _write(path: str, t: torch.Tensor) -> Dict[str, Any]:
        """Stream ``t``'s bytes into a new ``.npy`` file; fsync.

        The calling thread writes 64 MiB chunks straight from ``t``'s memory (no copy)
        while :data:`_CRC_THREADS` threads compute each chunk's CRC-32 (the manifest keeps
        the header's and every chunk's).
        """
        hdr = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            hdr, {"descr": _DTYPES[t.dtype][0], "fortran_order": False, "shape": tuple(t.shape)})
        header = hdr.getvalue()
        flat = memoryview(_bytes_of(t))
        crcs = _Crcs()
        crcs.add(header)
        with open(path, "xb") as f:
            f.write(header)
            for a in range(0, len(flat), _CHUNK):
                chunk = flat[a:a + _CHUNK]
                crcs.add(chunk)
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        return {"bytes": len(header) + len(flat), "chunk": _CHUNK, "crc32": crcs.result()}


def _decode(v: Any, folder: str, files: Mapping[str, Any], where: str) -> Any:
    if isinstance(v, list):
        return [_decode(x, folder, files, f"{where}.{i}") for i, x in enumerate(v)]
    if isinstance(v, dict):
        if "__tensor__" in v and len(v) == 1:
            meta = v["__tensor__"]
            if not isinstance(meta, dict):
                raise StpipeValueError(f"{where}: malformed tensor entry")
            return _Inline(meta, where) if "data" in meta else _FileRef(folder, meta, files, where)
        if "__tuple__" in v and len(v) == 1:
            return tuple(_decode(x, folder, files, where) for x in _listed(v["__tuple__"], where))
        if "__items__" in v and len(v) == 1:
            out = {}
            for item in _listed(v["__items__"], where):
                if not isinstance(item, list) or len(item) != 2:
                    raise StpipeValueError(f"{where}: malformed dict entry")
                key = _decode(item[0], folder, files, where)
                if isinstance(key, list):
                    raise StpipeValueError(f"{where}: unhashable dict key")
                out[key] = _decode(item[1], folder, files, f"{where}.{key}")
            return out
        return {k: _decode(x, folder, files, f"{where}.{k}") for k, x in v.items()}
    return v


def _listed(v: Any, where: str) -> list:
    if not isinstance(v, list):
        raise StpipeValueError(f"{where}: malformed entry")
    return v


# ============================================================================ save/load
def _is_checkpoint(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MANIFEST))


def _discard(folder: str) -> None:
    """Remove a directory so that a crash never leaves it half-deleted under its name."""
    if not os.path.lexists(folder):
        return
    parent, base = os.path.split(folder)
    trash = tempfile.mkdtemp(prefix=_base_of(base) + ".trash-", dir=parent)
    os.rmdir(trash)
    os.rename(folder, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _new_folder(parent: str, prefix: str) -> str:
    """A new directory ``parent/prefix<random>`` with the umask's permissions, as ``mkdir``
    gives (``tempfile.mkdtemp``'s are 0700: a checkpoint others may read, like its files)."""
    for _ in range(100):
        path = os.path.join(parent, prefix + secrets.token_hex(4))
        try:
            os.mkdir(path, 0o777)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free name {prefix}* in {parent}")


def _base_of(base: str) -> str:
    return base[:-4] if base.endswith(".old") else base


def save(path: PathLike, obj: Any, optimizer: Any = None, extra: Any = None) -> str:
    """Write a checkpoint directory at ``path``, atomically.

    Waits for every write-back issued so far (batches in flight are fine; inside a step
    is refused), streams every table to a ``.npy`` file (64 MiB chunks, CRC-32 computed
    on the way, fsync), writes ``manifest.json`` last, then renames the directory into
    place (see the module docstring for the protocol and the recovery rule).

    Args:
        path: the checkpoint directory (created; an existing checkpoint is replaced).
        obj: a :class:`~stpipe.Pipeline`, a :class:`~stpipe.HostEmbedding`, or a dict/list
            of them.
        optimizer: the tables' optimizer(s) (default: the pipeline's, or those bound to
            the tables); their hyper-parameters and state of other parameters (dense
            layers) are saved too.
        extra: anything made of tensors, numbers, str, None, lists, tuples and dicts (a
            model's ``state_dict()``, the step number, ...); returned by :func:`load`.

    Returns:
        The absolute path written.

    Raises:
        StpipeRuntimeError: called inside a step.
        StpipeValueError: ``path`` exists and is not an stpipe checkpoint.
        StpipeTypeError: ``extra`` holds something that is not data.
        OSError: writing failed (the previous checkpoint is untouched; the temporary
            directory is removed).
    """
    target = os.path.abspath(os.fspath(path))
    parent, base = os.path.split(target)
    if not base:
        raise StpipeValueError(f"bad checkpoint path {path!r}")
    if os.path.lexists(target) and not (os.path.isdir(target) and _is_checkpoint(target)):
        raise StpipeValueError(
            f"{target} exists and is not an stpipe checkpoint (no {MANIFEST}); refusing to replace it"
        )
    os.makedirs(parent, exist_ok=True)
    sd = state_dict(obj, optimizer)
    _crash_point("start")
    for leftover in os.listdir(parent):  # garbage of crashed saves (one writer per path)
        if leftover.startswith(base + ".tmp-") or leftover.startswith(base + ".trash-"):
            shutil.rmtree(os.path.join(parent, leftover), ignore_errors=True)
    tmp = _new_folder(parent, base + ".tmp-")
    old = target + ".old"
    try:
        w = _Writer(tmp)
        body = {"state": w.encode(sd, "state"), "extra": w.encode(extra, "extra")}
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "torch": torch.__version__,
            "files": w.files,
            **body,
        }
        part = os.path.join(tmp, MANIFEST + ".part")
        with open(part, "x", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, allow_nan=True)
            f.flush()
            os.fsync(f.fileno())
        os.rename(part, os.path.join(tmp, MANIFEST))
        fsync_folder(tmp)
        _crash_point("manifest")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    aside = False
    try:
        if os.path.lexists(target):
            _discard(old)  # target is complete whenever both exist
            _crash_point("old-cleared")
            os.rename(target, old)
            aside = True
            fsync_folder(parent)
            _crash_point("aside")
        os.rename(tmp, target)
        fsync_folder(parent)
        _crash_point("in")
    except Exception:  # (a crash, which these steps are ordered for, raises nothing)
        if aside and not os.path.lexists(target):
            try:
                os.rename(old, target)  # the previous checkpoint back under its name
            except OSError:
                pass  # still loadable: load() falls back to path.old
        shutil.rmtree(tmp, ignore_errors=True)  # gone already if it became the target
        raise
    _discard(old)
    fsync_folder(parent)
    _crash_point("done")
    return target


def _resolve(path: PathLike) -> str:
    target = os.path.abspath(os.fspath(path))
    if _is_checkpoint(target):
        return target
    old = target + ".old"
    if _is_checkpoint(old):
        warnings.warn(
            f"{target} is missing; loading the previous checkpoint {old} (a save was "
            "interrupted between its renames)",
            RuntimeWarning,
            stacklevel=3,
        )
        return old
    if os.path.isdir(target):
        raise StpipeValueError(f"{target} has no {MANIFEST}: not an stpipe checkpoint, or an incomplete one")
    raise FileNotFoundError(f"no checkpoint at {target} (nor {old})")


def read_manifest(path: PathLike) -> Dict[str, Any]:
    """The parsed ``manifest.json`` of the checkpoint at ``path`` (``path.old`` as fallback).

    Raises:
        FileNotFoundError: no checkpoint there.
        StpipeValueError: not valid JSON or not an stpipe manifest.
    """
    folder = _resolve(path)
    mpath = os.path.join(folder, MANIFEST)
    if os.path.getsize(mpath) > _MANIFEST_MAX:
        raise StpipeValueError(f"{mpath} is larger than {_MANIFEST_MAX} bytes; not an stpipe manifest")
    try:
        with open(mpath, "r", encoding="utf-8") as f:
            m = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StpipeValueError(f"{mpath}: not valid JSON ({exc}); the checkpoint is corrupted") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise StpipeValueError(f"{mpath}: not an stpipe checkpoint manifest")
    if m.get("version") != VERSION:
        raise StpipeValueError(f"{mpath}: checkpoint version {m.get('version')!r} is not supported; expected {VERSION}")
    if not isinstance(m.get("files"), dict):
        raise StpipeValueError(f"{mpath}: no file table")
    m["_folder"] = folder
    return m


def load(path: PathLike, obj: Any, optimizer: Any = None, *, verify: str = "first") -> Any:
    """Load the checkpoint at ``path`` into a pipeline or tables (+ optimizers).

    Build the same objects as when saving (same table names, shapes, dtypes, same
    optimizer classes and parameter groups; hyper-parameters are overwritten with the
    saved ones), then load, before the first step of a run.

    Order of work: the manifest is parsed and checked against the targets; every file's
    header and size are checked; with ``verify="first"`` every file's CRC-32 is checked
    (one read pass); only then are the tables streamed in (``readinto`` straight into the
    host tables, the CRC checked again on the way). So a mismatched, truncated or
    corrupted checkpoint is refused before anything is written. ``verify="stream"``
    skips the first pass (one read instead of two): a corrupted file is then still
    refused, but only once it was read, and the tables loaded so far hold checkpoint rows
    (load a good checkpoint before training on).

    Args:
        path: the checkpoint directory (falls back to ``<path>.old``, see the module
            docstring).
        obj: a :class:`~stpipe.Pipeline`, a :class:`~stpipe.HostEmbedding`, or a dict/list
            of them. Tables given without any optimizer load the weights only.
        optimizer: the tables' optimizer(s) (default: the pipeline's, or those bound to
            the tables).
        verify: ``"first"`` (default) or ``"stream"``.

    Returns:
        The ``extra`` given to :func:`save` (tensors on the CPU).

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        StpipeValueError: a mismatch, a missing/truncated/corrupted file, a pickled file.
        StpipeRuntimeError: inside a step, or a pipeline run is active.
    """
    if verify not in ("first", "stream"):
        raise StpipeValueError(f"verify must be 'first' or 'stream', got {verify!r}")
    m = read_manifest(path)
    folder = m["_folder"]
    files = m["files"]
    sd = _decode(m.get("state"), folder, files, "state")
    extra = _decode(m.get("extra"), folder, files, "extra")
    tg = _Targets(obj, optimizer, bind=True)
    _check_loadable(tg)
    with_opt = _check(tg, sd)
    refs = list(_refs(sd)) + list(_refs(extra))
    # the files read into the live tables stay open from their check to their read: a
    # save to this path meanwhile then cannot mix another checkpoint's rows into them
    # (the other files are read into new memory before any table is written)
    held = {id(r) for t in sd["tables"] for r in _refs([t["weight"], t.get("row_state")])}
    try:
        for ref in refs:
            ref.check_header(hold=id(ref) in held)
        if verify == "first":
            ring = _ring(max([min(r.chunk, r.nbytes) for r in refs] + [1]))
            for ref in refs:
                ref.verify(ring)
            del ring
        extra = _materialize(extra, None)
        _apply(tg, sd, with_opt)
    finally:
        for ref in refs:
            ref.release()
    return extra

"""``HostEmbedding``: the ``nn.Module`` face of a host table.

The full table ``(num_rows, dim)`` lives in a :class:`~stpipe.host.HostTable` (pinned host
RAM on a CUDA machine). The module's only parameter, ``weight``, is a *working parameter*:
inside a pipeline step it holds exactly the step's unique rows ``(k, dim)`` on the device
(``weight.data`` is a view of a pipeline staging buffer), so any dense ``torch.optim``
optimizer built from ``emb.parameters()`` updates exactly those rows. Gradients are dense
``(k, dim)``; duplicates within a batch are summed, as ``nn.Embedding`` does.

``forward(ids)``:

* inside a step (between ``with step:`` and its end) with the ids object the pipeline
  planned (``step.ids``, or one part of it): ``F.embedding(plan.inverse, weight)``, no
  search and no synchronisation;
* inside a step with other ids (e.g. ``step.ids.to('cuda')``): the ids are located among the
  step's unique rows by ``searchsorted``; an id the step did not gather raises
  :class:`~stpipe.StpipeValueError` (this path synchronises once to check);
* outside a step: a read-only lookup (:meth:`HostEmbedding.lookup`) of global ids straight
  from the host table (gather, no prefetch, no gradient), e.g. for evaluation.

``padding_idx``, ``max_norm``, ``scale_grad_by_freq`` and sparse gradients are not offered.
``state_dict()`` does not contain the table (it can be tens of GB): save it with
``emb.table.save(path)``; optimizer state tables are ``emb.state_tables``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ._errors import StpipeIndexError, StpipeTypeError, StpipeValueError
from .optim import RowState
from .planner import plan as _plan

__all__ = ["HostEmbedding"]

_INITS = ("normal", "uniform", "zeros", "none")


@dataclass
class _Part:
    """One ids object of a step for this table: its slice of the step's inverse.

    A lookup given the very ``ids`` (or ``alias``) object, unedited since the plan (a
    tensor's version counter), takes ``inverse``; one whose values were edited in place
    since (masking ``ids[m] = MASK``) is located anew, as any other ids.
    """

    ids: Any
    inverse: torch.Tensor  # int32 (or int64) on the device, the ids' shape
    alias: Any = None  # the ids' copy in the step's moved batch (step.batch), if any
    version: int = -1  # ids._version when staged (-1: not a tensor)
    alias_version: int = -1


def _version(x: Any) -> int:
    """``x._version`` for a tensor (its in-place edit counter), else -1 (numpy arrays,
    lists and inference tensors have none)."""
    if isinstance(x, torch.Tensor):
        try:
            return x._version
        except RuntimeError:  # an inference tensor
            return -1
    return -1


@dataclass
class _Binding:
    """What forward needs during one step (set by the pipeline, cleared on exit)."""

    parts: List[_Part]
    unique: np.ndarray  # (k,) int64 sorted, host
    _unique_dev: Optional[torch.Tensor] = field(default=None, repr=False)
    #: called by the step's lookups (the pipeline's prefetch gate); ``None``: nothing to call
    on_lookup: Optional[Callable[[], None]] = field(default=None, repr=False)
    #: a view of each differentiable lookup output of the step, which holds the output
    #: until the pipeline clears the list at the step's exit; ``None``: not held. Why:
    #: ``stpipe.pipeline._make_hold``
    outputs: Optional[List[torch.Tensor]] = field(default=None, repr=False)
    #: bytes of lookup outputs :attr:`outputs` may still hold this step (a step that runs
    #: many forward/backward passes, e.g. gradient accumulation, keeps bounded memory)
    outputs_room: int = field(default=0, repr=False)

    def unique_on(self, device: torch.device) -> torch.Tensor:
        if self._unique_dev is None:
            self._unique_dev = torch.as_tensor(self.unique, device=device)
        return self._unique_dev


class HostEmbedding(nn.Module):
    """An embedding whose table lives in host memory; only a step's rows reach the device.

    Args:
        num_rows: rows of the table (the vocabulary size).
        dim: embedding dimension.
        dtype: ``torch.float32``, ``torch.float16`` or ``torch.bfloat16``.
        device: where working rows live; default ``cuda:current`` when CUDA is available,
            else ``cpu`` (the table's ``device``).
        pin: page-lock the host table (default: when CUDA is available).
        backend: gather/scatter backend of the host tables (``"auto"``, ``"torch"``,
            ``"cupy"``, ``"numba"``).
        init: ``"normal"`` (N(0, 1), like ``nn.Embedding``), ``"uniform"`` (U(-1/sqrt(dim),
            1/sqrt(dim))), ``"zeros"``, ``"none"`` (leave the table as allocated), or a
            callable ``fn(table)`` that initialises the :class:`~stpipe.host.HostTable`.
        generator: a ``torch.Generator`` for the random initialisers.
        table: an existing :class:`~stpipe.host.HostTable` to wrap (then ``num_rows``,
            ``dim`` and ``dtype`` must match it or be ``None``; ``init`` is not applied).
        capacity: initial row capacity of each staging buffer (grown on demand).

    Attributes:
        table: the :class:`~stpipe.host.HostTable`.
        weight: the working parameter ``(k, dim)`` (``(0, dim)`` outside a step).
        state_tables: ``{key: HostTable}`` of the optimizer's per-row state (after the
            first optimizer step in a pipeline).

    Raises:
        StpipeValueError: bad sizes, unknown ``init``, or a ``table`` that does not match.
        StpipeTypeError: unsupported ``dtype``.
    """

    def __init__(
        self,
        num_rows: Optional[int] = None,
        dim: Optional[int] = None,
        dtype: Optional[torch.dtype] = None,
        *,
        device: Union[str, torch.device, None] = None,
        pin: Optional[bool] = None,
        backend: str = "auto",
        init: Union[str, Callable[[Any], Any]] = "normal",
        generator: Optional[torch.Generator] = None,
        table: Any = None,
        capacity: int = 0,
    ) -> None:
        super().__init__()
        from .host import HostTable  # imported here: host.py is the table's module

        if table is not None:
            for name, want, got in (("num_rows", num_rows, table.num_rows), ("dim", dim, table.dim),
                                    ("dtype", dtype, table.dtype)):
                if want is not None and want != got:
                    raise StpipeValueError(
                        f"{name}={want!r} does not match the given table's {name}={got!r}; "
                        f"leave {name} out when passing table="
                    )
            self._table_kwargs = dict(device=table.device, pin=bool(getattr(table, "pinned", False)),
                                      backend=backend)
        else:
            if num_rows is None or dim is None:
                raise StpipeValueError("HostEmbedding needs num_rows and dim (or table=)")
            for name, v in (("num_rows", num_rows), ("dim", dim)):
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) <= 0:
                    raise StpipeValueError(f"{name} must be a positive int, got {v!r}")
            dtype = torch.float32 if dtype is None else dtype
            if dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise StpipeTypeError(
                    f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype}"
                )
            if not callable(init) and init not in _INITS:
                raise StpipeValueError(f"init must be one of {_INITS} or a callable, got {init!r}")
            table = HostTable(int(num_rows), int(dim), dtype, device=device, pin=pin, backend=backend)
            self._table_kwargs = dict(device=table.device, pin=pin, backend=backend)
            if callable(init):
                init(table)
            elif init == "normal":
                table.normal_(0.0, 1.0, generator=generator)
            elif init == "uniform":
                bound = 1.0 / float(dim) ** 0.5
                table.uniform_(-bound, bound, generator=generator)
            elif init == "zeros":
                table.zeros_()
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 0:
            raise StpipeValueError(f"capacity must be an int >= 0, got {capacity!r}")
        self.table = table
        self.num_rows = int(table.num_rows)
        self.embedding_dim = int(table.dim)
        self.dtype = table.dtype
        self.device = torch.device(table.device)
        self.capacity = int(capacity)
        self.weight = nn.Parameter(torch.empty(0, self.embedding_dim, dtype=self.dtype, device=self.device))
        self._binding: Optional[_Binding] = None
        self._row_state: Optional[RowState] = None

    # ------------------------------------------------------------------ properties
    @property
    def num_embeddings(self) -> int:
        """Alias of ``num_rows`` (the ``nn.Embedding`` name)."""
        return self.num_rows

    @property
    def dim(self) -> int:
        """Embedding dimension."""
        return self.embedding_dim

    @property
    def state_tables(self) -> Dict[str, Any]:
        """``{key: HostTable}``: the optimizer's per-row state (empty before discovery)."""
        return dict(self._row_state.tables) if self._row_state is not None else {}

    @property
    def row_state(self) -> Optional[RowState]:
        """The :class:`~stpipe.optim.RowState` of the optimizer bound by a pipeline."""
        return self._row_state

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> "HostEmbedding":
        """``module.to()``, ``.cuda()``, ``.half()``, ...: a no-op for this module's dtype
        and device, refused for another.

        The table's dtype and the device its rows go to are fixed at construction (the
        host table, its pinning and the pipeline's staging follow them); converting only
        the working parameter left lookups in the old dtype and device.

        Raises:
            StpipeTypeError: a conversion to another dtype or device (say which; build
                the embedding with ``dtype=`` / ``device=`` instead).
        """
        probe = torch.empty(0, self.embedding_dim, dtype=self.dtype, device=self.device)
        got = fn(probe)
        if isinstance(got, torch.Tensor) and (got.dtype != self.dtype or got.device != self.device):
            raise StpipeTypeError(
                f"HostEmbedding holds {self.dtype} rows that go to {self.device}; a module "
                f"conversion to {got.dtype} on {got.device} (model.to(), .cuda(), .half(), "
                "...) would change only its working rows. Build it with dtype= and device= "
                "as wanted, and convert the other layers alone (e.g. model.head.half())"
            )
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (f"{self.num_rows}, {self.embedding_dim}, dtype={self.dtype}, device={self.device}, "
                f"pinned={getattr(self.table, 'pinned', False)}")

    # ------------------------------------------------------------ optimizer state
    def _make_state_table(self, key: str, dtype: torch.dtype, fresh_row: torch.Tensor):
        """Create the host table of one per-row state key, every row ``fresh_row``."""
        from .host import HostTable

        kw = dict(self._table_kwargs)
        t = HostTable(self.num_rows, self.embedding_dim, dtype, **kw)
        t.zeros_()
        row = fresh_row.to(dtype=dtype)
        if bool((row != 0).any()):
            if bool((row == row[0]).all()):
                t.init_(torch.nn.init.constant_, float(row[0]))
            else:
                view = t.tensor()
                step = 1 << 16
                for a in range(0, self.num_rows, step):
                    b = min(a + step, self.num_rows)
                    view[a:b].copy_(row.expand(b - a, -1))
        return t

    def bind_optimizer(self, optimizer: Optional[torch.optim.Optimizer]) -> Optional[RowState]:
        """Attach ``optimizer``'s per-row state to this table (done by the pipeline).

        Re-binding the same optimizer keeps its state tables; a different optimizer starts
        new ones (the old state tables are dropped).

        Raises:
            StpipeValueError: ``weight`` is not a parameter of ``optimizer``.
        """
        if optimizer is None:
            return self._row_state
        if self._row_state is not None and self._row_state.optimizer is optimizer:
            return self._row_state
        self._row_state = RowState(optimizer, self.weight, self._make_state_table)
        return self._row_state

    # ------------------------------------------------------------------ binding
    def _bind(self, binding: Optional[_Binding]) -> None:
        # a plain attribute (never a parameter, buffer or module): set without
        # nn.Module.__setattr__'s checks, twice per step and table
        object.__setattr__(self, "_binding", binding)

    # -------------------------------------------------------------- checkpoints
    def host_state_dict(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
        """The table, its per-row optimizer state and the optimizer's scalar state.

        What :meth:`state_dict` leaves out (it can be tens of GB): the host table and the
        state tables as *views* (no copy), plus the optimizer's hyper-parameters and
        scalar state; see :func:`stpipe.checkpoint.state_dict`. Write it to disk with
        :meth:`save_checkpoint` (streamed, no second copy in RAM).

        Args:
            optimizer: the optimizer training this table (default: the one bound to it).

        Raises:
            StpipeRuntimeError: called inside a step.
        """
        from . import checkpoint

        return checkpoint.state_dict(self, optimizer)

    def load_host_state_dict(self, state: Dict[str, Any],
                             optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Load :meth:`host_state_dict` output (see :func:`stpipe.checkpoint.load_state_dict`)."""
        from . import checkpoint

        checkpoint.load_state_dict(self, state, optimizer)

    def save_checkpoint(self, path: Any, optimizer: Optional[torch.optim.Optimizer] = None,
                        extra: Any = None) -> str:
        """Write a checkpoint directory (see :func:`stpipe.checkpoint.save`)."""
        from . import checkpoint

        return checkpoint.save(path, self, optimizer, extra)

    def load_checkpoint(self, path: Any, optimizer: Optional[torch.optim.Optimizer] = None,
                        *, verify: str = "first") -> Any:
        """Load a checkpoint directory; returns its ``extra`` (see :func:`stpipe.checkpoint.load`)."""
        from . import checkpoint

        return checkpoint.load(path, self, optimizer, verify=verify)

    def _restore_row_state(self, discovered: bool, keys: Tuple[str, ...], scalar_keys: Tuple[str, ...],
                           tables: Dict[str, Any]) -> None:
        """Install per-row state loaded from a checkpoint into the bound :class:`RowState`."""
        rs = self._row_state
        if rs is None:
            return
        rs.tables = dict(tables)
        rs.scalar_keys = tuple(scalar_keys)
        rs.keys = tuple(keys)
        rs.discovered = bool(discovered)
        if not rs.discovered:
            # the state is found again at the next step, by comparing its tensors' shapes
            # with the parameter's: give it the shape it had when the state was saved
            # (before the first step; not the last step's working rows)
            self.weight.grad = None
            self.weight.data = torch.empty(0, self.embedding_dim, dtype=self.dtype, device=self.device)

    # -------------------------------------------------------------------- forward
    def lookup(self, ids: Any) -> torch.Tensor:
        """Read rows of global ids from the host table (no gradient, no prefetch).

        Args:
            ids: integer ids of any shape (numpy, torch, list).

        Returns:
            ``ids.shape + (dim,)`` on the embedding's device.

        Raises:
            StpipeIndexError, StpipeTypeError: bad ids (before any copy).
        """
        p = _plan(ids, self.num_rows)
        with torch.no_grad():
            rows = self.table.gather(p.unique)
            rows = rows.to(self.device)
            inv = torch.as_tensor(p.inverse, device=self.device)
            return F.embedding(inv, rows)

    def forward(self, ids: Any) -> torch.Tensor:
        """Embed global row ids: ``ids.shape + (dim,)``.

        Inside a pipeline step the rows come from the working parameter (differentiable);
        outside, from the host table (:meth:`lookup`).

        Raises:
            StpipeValueError: inside a step, an id the step did not gather.
            StpipeIndexError, StpipeTypeError: bad ids (out of range, not integers), inside
                a step too.
        """
        b = self._binding
        if b is None:
            return self.lookup(ids)
        if b.on_lookup is not None:
            b.on_lookup()
        for part in b.parts:
            if ((part.ids is ids and _version(ids) == part.version)
                    or (part.alias is ids and part.alias is not None
                        and _version(ids) == part.alias_version)):
                # F.embedding without its Python checks (no padding_idx, no max_norm)
                out = torch.embedding(self.weight, part.inverse)
                if b.outputs is not None and out.requires_grad:
                    n = out.nbytes
                    if n <= b.outputs_room:
                        b.outputs_room -= n
                        b.outputs.append(out.view_as(out))
                return out
        try:
            pos = self._locate(b, ids)
        except StpipeValueError as exc:
            if any(part.ids is ids or (part.alias is not None and part.alias is ids) for part in b.parts):
                raise StpipeValueError(
                    f"{exc}. These ids were edited in place after the pipeline planned them: "
                    "edit a batch before it reaches the pipeline (in a collate_fn, or a map "
                    "over the loader), so that the step gathers the rows it uses"
                ) from None
            raise
        return F.embedding(pos, self.weight)

    def _locate(self, b: _Binding, ids: Any) -> torch.Tensor:
        """Positions of ``ids`` among the step's unique rows (synchronises once)."""
        if torch.is_tensor(ids):
            if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
                raise StpipeTypeError(f"row ids must be an integer tensor, got dtype {ids.dtype}")
            t = ids.to(self.device, torch.int64)
        else:
            from .planner import as_index_array

            t = torch.as_tensor(as_index_array(ids), device=self.device).long()
        flat = t.reshape(-1)
        uniq = b.unique_on(self.device)
        k = int(uniq.shape[0])
        if flat.numel() == 0:
            return flat.reshape(t.shape)
        if k == 0:
            raise StpipeValueError(
                f"row id {int(flat[0])} at position 0 is not among this step's rows (the "
                "step gathered none); pass step.ids (or ids the pipeline planned) to the "
                "embedding inside a step"
            )
        pos = torch.searchsorted(uniq, flat).clamp_(max=k - 1)
        ok = uniq[pos] == flat
        if not bool(ok.all()):
            out = (flat < 0) | (flat >= self.num_rows)
            if bool(out.any()):  # not a row at all: the range error of every other path
                bad = int(torch.nonzero(out)[0, 0])
                raise StpipeIndexError(
                    f"row id {int(flat[bad])} at position {bad} is out of range: expected "
                    f"0 <= id < num_rows={self.num_rows}"
                )
            bad = int(torch.nonzero(~ok)[0, 0])
            raise StpipeValueError(
                f"row id {int(flat[bad])} at position {bad} is not among this step's rows; "
                "inside a step the embedding can only look up ids the pipeline planned "
                "(pass step.ids, or use emb.lookup(ids) for read-only access)"
            )
        return pos.reshape(t.shape)

    # --------------------------------------------------------------- state_dict
    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: D401
        # the working rows are transient; the table is saved with emb.table.save(path)
        for name, buf in self._buffers.items():
            if buf is not None and name not in self._non_persistent_buffers_set:
                destination[prefix + name] = buf if keep_vars else buf.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        # nn.Module's loading (buffers, load pre-hooks, strict key checks) for all but
        # the working rows, which are transient and never in a state_dict; a "weight"
        # given (an nn.Embedding's checkpoint) is unexpected: the table is not loaded
        # from a state_dict (emb.table.copy_from, emb.load_checkpoint do that)
        key = prefix + "weight"
        given = key in state_dict
        rest = {k: v for k, v in state_dict.items() if k != key} if given else state_dict
        super()._load_from_state_dict(rest, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
        if key in missing_keys:
            missing_keys.remove(key)
        if given:  # (torch passes strict=True to every module and filters after)
            unexpected_keys.append(key)

"""Optimizer-state offload: any ``torch.optim`` optimizer's per-row state travels with the rows.

A :class:`~stpipe.embedding.HostEmbedding` trains through a *working parameter* that holds
only the current step's unique rows, ``(k, dim)``. A dense optimizer keeps, for that
parameter, state tensors of the parameter's shape (Adam's ``exp_avg`` and ``exp_avg_sq``,
Adagrad's ``sum``, ...) plus scalar state (``step``, ASGD's ``eta`` and ``mu``, NAdam's
``mu_product``). :class:`RowState` splits that state:

* **per-row state** (a tensor whose shape equals the parameter's): one host table
  ``(num_rows, dim)`` per state key, gathered and scattered with the rows. Each step the
  pipeline installs views of device buffers, ``optimizer.state[param][key] = buf[:k]``,
  so the optimizer updates exactly the batch's rows with their own stored state.
* **scalar state** (0-d tensors and Python values): stays in ``optimizer.state[param]``,
  one value per table, as in ``SparseAdam`` (``step`` counts the table's steps).
* anything else (e.g. ``Adafactor``'s factored ``row_var`` ``(k, 1)`` / ``col_var``
  ``(1, dim)``): cannot be split by row, so :class:`~stpipe.StpipeValueError` names the key.

**Discovery.** State keys are discovered after the first ``optimizer.step()`` that gave the
parameter state (before it, ``optimizer.state[param]`` is empty and the optimizer initialises
its own state for the first batch's rows, as a fresh optimizer does). Host state tables are
created then, every row filled with the value a *fresh* optimizer gives a row.

**Fresh-row values** come from a probe: an optimizer of the same class and hyperparameters
over a dummy ``(2, dim)`` parameter whose state dict records the *first* value assigned to
each key (the value a fresh optimizer creates, before its first update touches it). This is
exact for every ``torch.optim`` optimizer and needs no per-class table:

============  =========================================  ==============================
optimizer     per-row keys                               fresh value
============  =========================================  ==============================
SGD           ``momentum_buffer`` (momentum != 0)         0 (see note)
Adam(W)       ``exp_avg``, ``exp_avg_sq``,                0
              ``max_exp_avg_sq`` (amsgrad)
Adamax        ``exp_avg``, ``exp_inf``                    0
NAdam, RAdam  ``exp_avg``, ``exp_avg_sq``                 0
Adagrad       ``sum``                                     ``initial_accumulator_value``
Adadelta      ``square_avg``, ``acc_delta``               0
RMSprop       ``square_avg``, ``momentum_buffer``,        0
              ``grad_avg`` (centered)
Rprop         ``prev``, ``step_size``                     0, ``lr``
ASGD          ``ax``                                      0
============  =========================================  ==============================

Note on SGD: torch's SGD has no initial buffer, it sets ``buf = grad`` on the parameter's
first step. In stpipe the first batch's rows get exactly that; a row first seen later
starts from ``buf = 0``, so its first update uses ``(1 - dampening) * grad``: identical for
the default ``dampening=0``, and what a dense SGD over the whole table would do otherwise.

**Failure.** :meth:`RowState.snapshot` / :meth:`RowState.restore` save and restore the
scalar state around a step, so a step that raises leaves ``step`` (and ASGD's ``eta``/``mu``)
as they were; per-row state of a failed step lives only in that step's device buffers and
is never written back.
"""
from __future__ import annotations

import copy
import inspect
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from ._errors import StpipeRuntimeError, StpipeTypeError, StpipeValueError

__all__ = ["RowState", "split_state", "fresh_row_state", "find_group"]


def find_group(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> Dict[str, Any]:
    """Return the param group of ``optimizer`` that holds ``param``.

    Raises:
        StpipeTypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        StpipeValueError: ``param`` is in none of its groups.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise StpipeTypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p is param:
                return group
    raise StpipeValueError(
        f"the embedding's weight is not among the parameters of {type(optimizer).__name__}; "
        "build the optimizer from emb.parameters() (or model.parameters())"
    )


def split_state(
    optimizer: torch.optim.Optimizer, param: torch.Tensor
) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """Split ``optimizer.state[param]`` into per-row and scalar keys.

    Args:
        optimizer: any ``torch.optim`` optimizer.
        param: the working parameter ``(k, dim)``.

    Returns:
        ``(per_row_keys, scalar_keys)``, each in the state dict's order.

    Raises:
        StpipeValueError: a state tensor is neither 0-d nor of the parameter's shape; the
            message names the key (this state cannot travel with rows).
    """
    state = optimizer.state.get(param, {})
    per_row: List[str] = []
    scalar: List[str] = []
    for key, value in state.items():
        if torch.is_tensor(value):
            if value.dim() == 0:
                scalar.append(key)
            elif tuple(value.shape) == tuple(param.shape):
                per_row.append(key)
            else:
                raise StpipeValueError(
                    f"{type(optimizer).__name__} keeps state {key!r} of shape "
                    f"{tuple(value.shape)} for a parameter of shape {tuple(param.shape)}: "
                    "it cannot be split by row, so stpipe cannot offload it; use an "
                    "optimizer whose state is per element (Adam, Adagrad, RMSprop, ...) "
                    "or scalar"
                )
        else:
            scalar.append(key)
    return tuple(per_row), tuple(scalar)


class _FirstValueDict(dict):
    """A state dict that remembers the first tensor stored under each key."""

    def __init__(self) -> None:
        super().__init__()
        self.first: Dict[str, torch.Tensor] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self.first and torch.is_tensor(value):
            self.first[key] = value.detach().clone()
        super().__setitem__(key, value)


def _probe(optimizer: torch.optim.Optimizer, group: Dict[str, Any], dummy: torch.Tensor):
    cls = type(optimizer)
    hyper = {k: v for k, v in group.items() if k != "params"}
    try:
        sig = inspect.signature(cls.__init__)
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
        kwargs = {k: v for k, v in hyper.items() if takes_any or k in sig.parameters}
        probe = cls([dummy], **kwargs)
    except Exception as exc:
        raise StpipeValueError(
            f"cannot build a probe {cls.__name__} to learn the state of a fresh row: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    probe.param_groups[0].update(hyper)
    return probe


def fresh_row_state(
    optimizer: torch.optim.Optimizer,
    param: torch.Tensor,
    keys: Optional[Iterable[str]] = None,
) -> Dict[str, torch.Tensor]:
    """The per-row state a fresh ``optimizer`` gives a row, one ``(dim,)`` tensor per key.

    Runs one step of a probe optimizer (same class, same hyperparameters as ``param``'s
    group) over a zero dummy ``(2, dim)`` parameter with a zero gradient, on ``param``'s
    device and dtype, and records the first value stored under each state key.

    Args:
        optimizer: the optimizer that trains ``param``.
        param: the working parameter (only its device, dtype and ``dim`` are used).
        keys: the keys wanted (default: every per-row key of the probe).

    Returns:
        ``{key: (dim,) tensor}`` on ``param``'s device.

    Raises:
        StpipeValueError: the probe cannot be built or stepped, a wanted key is missing,
            or a fresh value differs between rows.
    """
    group = find_group(optimizer, param)
    dim = int(param.shape[-1])
    dummy = torch.nn.Parameter(torch.zeros(2, dim, dtype=param.dtype, device=param.device))
    dummy.grad = torch.zeros_like(dummy)
    probe = _probe(optimizer, group, dummy)
    recorder = _FirstValueDict()
    # some optimizers create their state in __init__ (Adagrad's ``sum`` and ``step`` on
    # torch <= 2.11) and their step() expects it: those first values are the fresh ones
    for key, value in probe.state.get(dummy, {}).items():
        recorder[key] = value
    probe.state = defaultdict(dict)
    probe.state[dummy] = recorder
    try:
        probe.step()
    except Exception as exc:
        raise StpipeValueError(
            f"a probe step of {type(optimizer).__name__} on a zero (2, {dim}) parameter "
            f"failed: {type(exc).__name__}: {exc}"
        ) from exc
    out: Dict[str, torch.Tensor] = {}
    wanted = list(keys) if keys is not None else [
        k for k, v in recorder.first.items() if tuple(v.shape) == (2, dim)
    ]
    for key in wanted:
        value = recorder.first.get(key)
        if value is None or tuple(value.shape) != (2, dim):
            raise StpipeValueError(
                f"{type(optimizer).__name__} state {key!r}: a fresh optimizer does not "
                f"create it with the parameter's shape (got "
                f"{None if value is None else tuple(value.shape)}); it cannot be split by row"
            )
        if not torch.equal(value[0], value[1]):
            raise StpipeValueError(
                f"{type(optimizer).__name__} state {key!r}: the fresh value differs "
                "between rows; stpipe cannot give a new row its initial state"
            )
        out[key] = value[0].clone()
    return out


#: Makes the host table of one state key: ``(key, dtype, fresh_row) -> HostTable``.
TableFactory = Callable[[str, torch.dtype, torch.Tensor], Any]


class _Saved:
    """A CPU scalar state tensor's value saved by :meth:`RowState.snapshot` as numpy."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array


class RowState:
    """The per-row state of one table's working parameter under one optimizer.

    The host tables live here (``tables[key]``, one ``(num_rows, dim)`` table per per-row
    key); the pipeline owns the device buffers and calls :meth:`install` to point the
    optimizer at them.

    Args:
        optimizer: the optimizer training ``param``.
        param: the working parameter of a :class:`~stpipe.HostEmbedding`.
        make_table: ``(key, dtype, fresh_row) -> HostTable`` creating one state table
            filled with ``fresh_row`` in every row.

    Raises:
        StpipeTypeError, StpipeValueError: see :func:`find_group`.
        StpipeTypeError: ``optimizer`` is a ``torch.optim.SparseAdam``, which takes sparse
            gradients only; the working parameter's gradient is dense (use ``Adam``); or a
            ``torch.optim.LBFGS``, whose state is one flat vector over all its parameters.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, param: torch.Tensor,
                 make_table: TableFactory) -> None:
        find_group(optimizer, param)
        if isinstance(optimizer, torch.optim.SparseAdam):
            # it would fail only at the first optimizer.step(), inside the user's step
            raise StpipeTypeError(
                "a HostEmbedding cannot be trained by torch.optim.SparseAdam: it takes sparse "
                "gradients only, and the working rows' gradient is dense (the step's unique "
                "rows); expected a dense optimizer such as torch.optim.Adam, which stpipe "
                "applies to those rows alone, got SparseAdam"
            )
        if isinstance(optimizer, torch.optim.LBFGS):
            # its state is one flat vector over all its parameters, kept under the first
            # one: with a dense layer first, stpipe would never see it
            raise StpipeTypeError(
                "a HostEmbedding cannot be trained by torch.optim.LBFGS: it keeps one flat "
                "state over all its parameters ('d', 'prev_flat_grad', 'old_dirs', ...), "
                "which cannot be split by row; expected an optimizer with per-parameter "
                "state such as torch.optim.Adam, got LBFGS"
            )
        self.optimizer = optimizer
        self.param = param
        self._make_table = make_table
        #: per-row keys, published (last) once their tables exist
        self.keys: Tuple[str, ...] = ()
        self.scalar_keys: Tuple[str, ...] = ()
        self.tables: Dict[str, Any] = {}
        self.discovered = False
        #: key -> (scalar state tensor, its data pointer, numpy view) (:meth:`_copy_scalar`)
        self._views: Dict[str, Tuple[torch.Tensor, int, np.ndarray]] = {}

    def __repr__(self) -> str:
        return (f"RowState({type(self.optimizer).__name__}, keys={list(self.keys)}, "
                f"scalar_keys={list(self.scalar_keys)})")

    def _state(self) -> Optional[Dict[str, Any]]:
        st = self.optimizer.state
        return st[self.param] if self.param in st else None

    def discover(self) -> bool:
        """Learn the state keys after an ``optimizer.step()``; create the host tables.

        Returns:
            True once the keys are known (the optimizer has state for the parameter).

        Raises:
            StpipeValueError: unsplittable state (names the key), or a per-row key that
                appeared after discovery.
        """
        state = self._state()
        if not state:
            return self.discovered
        if self.discovered:
            if len(state) != len(self.keys) + len(self.scalar_keys):
                known = set(self.keys) | set(self.scalar_keys)
                for key, value in state.items():
                    if key in known:
                        continue
                    if torch.is_tensor(value) and value.dim() > 0:
                        raise StpipeValueError(
                            f"{type(self.optimizer).__name__} added per-row state {key!r} "
                            "after its first step; stpipe discovers state keys once"
                        )
                    self.scalar_keys = self.scalar_keys + (key,)
            return True
        per_row, scalar = split_state(self.optimizer, self.param)
        fresh = fresh_row_state(self.optimizer, self.param, per_row) if per_row else {}
        tables = {}
        for key in per_row:
            tables[key] = self._make_table(key, state[key].dtype, fresh[key].cpu())
        self.tables = tables
        self.scalar_keys = scalar
        self.keys = per_row  # published last: readers take keys, then tables[key]
        self.discovered = True
        return True

    def install(self, views: Dict[str, torch.Tensor]) -> None:
        """Point ``optimizer.state[param][key]`` at ``views[key]`` (each ``(k, dim)``)."""
        if not views:
            return
        state = self.optimizer.state[self.param]
        for key, view in views.items():
            state[key] = view

    def current(self, key: str) -> torch.Tensor:
        """The tensor the optimizer holds now under ``key``.

        Raises:
            StpipeRuntimeError: the optimizer dropped the key.
        """
        state = self._state()
        if state is None or key not in state:
            raise StpipeRuntimeError(
                f"{type(self.optimizer).__name__} has no state {key!r} for the embedding "
                "any more (was optimizer.state cleared during the step?)"
            )
        return state[key]

    def snapshot(self) -> Optional[Dict[str, Any]]:
        """Copy the scalar state (``None`` when the optimizer has none for the parameter)."""
        state = self._state()
        if not state:
            return None
        per_row = self.keys
        out: Dict[str, Any] = {}
        for k, v in state.items():
            if k in per_row:
                continue
            out[k] = self._copy_scalar(k, v) if isinstance(v, torch.Tensor) else copy.copy(v)
        return out

    def _copy_scalar(self, key: str, v: torch.Tensor) -> Any:
        """A copy of scalar state ``v`` for :meth:`restore`. Every step snapshots Adam's
        ``step`` (a CPU tensor updated in place), so a CPU tensor is read through a numpy
        view made once per tensor: a numpy copy, no torch call (each may hand the GIL
        to the prefetch thread); :class:`_Saved` turns it back into a tensor."""
        hit = self._views.get(key)
        if hit is not None and hit[0] is v and hit[1] == v.data_ptr():
            return _Saved(hit[2].copy())
        if v.device.type == "cpu" and not v.requires_grad and v.layout == torch.strided:
            try:
                arr = v.numpy()
            except (RuntimeError, TypeError):  # bfloat16, conj/neg bits, ...
                arr = None
            if arr is not None:
                self._views[key] = (v, v.data_ptr(), arr)
                return _Saved(arr.copy())
        return v.detach().clone()

    def restore(self, snap: Optional[Dict[str, Any]]) -> None:
        """Undo a failed step: put back the scalar state saved by :meth:`snapshot`."""
        if snap is None:
            self.optimizer.state.pop(self.param, None)
            return
        state = self.optimizer.state[self.param]
        for k in [k for k in state if k not in snap and k not in self.keys]:
            del state[k]
        for k, v in snap.items():
            state[k] = torch.from_numpy(v.array) if isinstance(v, _Saved) else v

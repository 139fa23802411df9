"""The index planner: deduplicate, sort and invert one batch of row ids.

A :class:`Plan` tells the transfer engine which rows to move (``unique``, sorted
ascending, so reads from host memory run in address order) and tells the model how to
map every input position onto the moved rows (``inverse``). :func:`overlap` finds the
rows two consecutive plans share, which the pipeline carries device-to-device instead
of reading stale host rows.

Two implementations give identical results:

* ``cython``: :mod:`stpipe._planner`, compiled on install; the work runs with the GIL
  released (hash dedup + radix sort of the distinct ids).
* ``numpy``: the pure-numpy twin below, the fallback when the extension is missing and
  the oracle of the tests.

``STPIPE_PLANNER=numpy`` (or ``cython``) forces one; the default ``auto`` takes the
compiled one when it imports. Example::

    >>> import numpy as np
    >>> from stpipe.planner import plan
    >>> p = plan(np.array([[7, 3], [7, 9]]), num_rows=10)
    >>> p.unique.tolist(), p.inverse.tolist(), p.counts.tolist()
    ([3, 7, 9], [[1, 0], [1, 2]], [1, 2, 1])
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ._errors import StpipeIndexError, StpipeTypeError, StpipeValueError

__all__ = ["Plan", "plan", "overlap", "implementation", "check_ids", "as_index_array", "first_repeat",
           "scan_ids", "same_ids"]

try:  # the compiled planner; absent when the package was not built
    from . import _planner as _compiled
except ImportError:  # pragma: no cover - depends on the build
    _compiled = None

_ENV = "STPIPE_PLANNER"


def implementation() -> str:
    """Return the active planner implementation: ``"cython"`` or ``"numpy"``.

    Raises:
        StpipeValueError: ``STPIPE_PLANNER`` holds an unknown value, or asks for
            ``cython`` where the extension is not built.
    """
    want = os.environ.get(_ENV, "auto").strip().lower()
    if want not in ("auto", "cython", "numpy"):
        raise StpipeValueError(
            f"{_ENV} must be 'auto', 'cython' or 'numpy', got {want!r}"
        )
    if want == "numpy":
        return "numpy"
    if _compiled is None:
        if want == "cython":
            raise StpipeValueError(
                f"{_ENV}=cython but the compiled planner stpipe._planner is not built; "
                "reinstall with `pip install -e .` (needs Cython and a C compiler)"
            )
        return "numpy"
    return "cython"


@dataclass(frozen=True)
class Plan:
    """The plan of one batch.

    Attributes:
        unique: ``(k,)`` int64, the distinct ids, ascending.
        inverse: int64 of the input's shape; ``unique[inverse] == ids``.
        counts: ``(k,)`` int64, occurrences of each unique id.
        num_rows: the row count the ids were checked against.
    """

    unique: np.ndarray
    inverse: np.ndarray
    counts: np.ndarray
    num_rows: int

    @property
    def num_unique(self) -> int:
        """Number of distinct ids ``k``."""
        return int(self.unique.shape[0])

    @property
    def num_ids(self) -> int:
        """Number of ids in the batch (all positions, duplicates included)."""
        return int(self.inverse.size)

    def __repr__(self) -> str:
        return (
            f"Plan(num_ids={self.num_ids}, num_unique={self.num_unique}, "
            f"shape={tuple(self.inverse.shape)}, num_rows={self.num_rows})"
        )


def _check_num_rows(num_rows: Any) -> int:
    if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)):
        raise StpipeTypeError(
            f"num_rows must be an int, got {type(num_rows).__name__} {num_rows!r}"
        )
    num_rows = int(num_rows)
    if num_rows <= 0:
        raise StpipeValueError(f"num_rows must be > 0, got {num_rows}")
    return num_rows


def _check_tensor_dtype(t: Any) -> None:
    """Raise StpipeTypeError for a torch tensor of bool, floating or complex ids."""
    import torch

    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise StpipeTypeError(
            f"row ids must be an integer tensor (int64, int32 or another integer dtype), "
            f"got dtype {t.dtype}"
        )


def as_index_array(ids: Any) -> np.ndarray:
    """Turn ids into a C-contiguous int32 or int64 numpy array of the same shape.

    Accepts numpy arrays, torch tensors (CPU; a CUDA tensor is copied to the host, which
    synchronises with its stream), lists, tuples and Python ints. Other integer dtypes
    are widened to int64. Contiguous int32/int64 input is not copied.

    Raises:
        StpipeTypeError: float, complex, bool or object ids.
        StpipeIndexError: unsigned ids that do not fit in int64.
    """
    if isinstance(ids, np.ndarray):  # first: the commonest, and cheaper than hasattr misses
        arr = ids
    elif hasattr(ids, "detach") and hasattr(ids, "dtype") and hasattr(ids, "cpu"):
        try:  # the usual CPU integer tensor: one call (each torch call may hand the GIL over)
            arr = ids.numpy()
        except (RuntimeError, TypeError):  # on a GPU, requires grad, no numpy dtype
            arr = None
        if arr is None or arr.dtype.kind not in "iu":
            _check_tensor_dtype(ids)
            arr = ids.detach().cpu().numpy()
    else:
        if isinstance(ids, (list, tuple)) and len(ids) == 0:
            return np.empty(0, dtype=np.int64)
        if isinstance(ids, (bool, np.bool_)):
            raise StpipeTypeError("row ids must be integers, got a bool")
        arr = np.asarray(ids)
    kind = arr.dtype.kind
    if kind == "b":
        raise StpipeTypeError(
            f"row ids must be integers (any integer dtype; int64 or int32 are used as given), "
            f"got dtype {arr.dtype}"
        )
    if kind not in "iu":
        if arr.size == 0 and kind == "f" and not isinstance(ids, np.ndarray):
            return np.empty(arr.shape, dtype=np.int64)
        raise StpipeTypeError(
            f"row ids must be integers (any integer dtype; int64 or int32 are used as given), "
            f"got dtype {arr.dtype}; cast them with .astype(np.int64) / .long() if they hold "
            "whole numbers"
        )
    if arr.dtype == np.int32 or arr.dtype == np.int64:  # (ascontiguousarray makes 0-d 1-d)
        return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        pos = int(np.argmax(arr > np.iinfo(np.int64).max))
        raise StpipeIndexError(
            f"row id {int(arr.reshape(-1)[pos])} at position {pos} does not fit in int64"
        )
    return arr.astype(np.int64, order="C")


def _first_out_of_range_numpy(flat: np.ndarray, num_rows: int) -> int:
    if flat.size == 0:
        return -1
    bad = (flat < 0) | (flat >= num_rows)
    pos = int(np.argmax(bad))
    return pos if bad[pos] else -1


def _raise_out_of_range(arr: np.ndarray, flat: np.ndarray, pos: int, num_rows: int) -> None:
    where = f"position {pos}"
    if arr.ndim > 1:
        where += f" (index {tuple(int(i) for i in np.unravel_index(pos, arr.shape))})"
    raise StpipeIndexError(
        f"row id {int(flat[pos])} at {where} is out of range: expected 0 <= id < "
        f"num_rows={num_rows}"
    )


def check_ids(ids: Any, num_rows: int) -> np.ndarray:
    """Validate row ids and return them as a contiguous int32/int64 array (input shape).

    Raises:
        StpipeTypeError: non-integer ids or ``num_rows``.
        StpipeValueError: ``num_rows <= 0``.
        StpipeIndexError: an id outside ``[0, num_rows)``; names the first one and its
            position.
    """
    return _check(ids, num_rows, order=False)[0]


def _check(ids: Any, num_rows: int, order: bool) -> tuple[np.ndarray, int]:
    """:func:`check_ids` (``order`` False: the order returned is 0, not computed) or
    :func:`scan_ids` (``order`` True)."""
    num_rows = _check_num_rows(num_rows)
    arr = as_index_array(ids)
    flat = arr.reshape(-1)
    found = 0
    if implementation() == "cython":
        if order:
            pos, found = _compiled.scan_ids(flat, num_rows)
        else:
            pos = _compiled.first_out_of_range(flat, num_rows)
    else:
        pos = _first_out_of_range_numpy(flat, num_rows)
        if order and pos < 0:
            found = _order_numpy(flat)
    if pos >= 0:
        _raise_out_of_range(arr, flat, pos, num_rows)
    return arr, int(found)


def _order_numpy(flat: np.ndarray) -> int:
    """Pure-numpy twin of the order half of :func:`stpipe._planner.scan_ids` (ids already
    range-checked, so neighbour differences cannot overflow)."""
    if flat.shape[0] < 2:
        return 2
    d = flat[1:] - flat[:-1]
    if bool((d > 0).all()):
        return 2
    return 1 if bool((d >= 0).all()) else 0


def scan_ids(ids: Any, num_rows: int) -> tuple[np.ndarray, int]:
    """:func:`check_ids` and the ids' order, from one compiled pass over them.

    Returns:
        ``(arr, order)``: the checked ids (as :func:`check_ids` returns them) and their
        order in flattened form, 2 (strictly increasing, hence distinct), 1
        (non-decreasing) or 0 (neither). Callers that would test sortedness after the
        range check (a host table, the SpeedTorch ``DataGadget``) read it here instead of
        making a second pass.

    Raises:
        As :func:`check_ids`.
    """
    return _check(ids, num_rows, order=True)


def same_ids(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether the id arrays ``a`` and ``b`` are equal (same shape and values): one
    ``memcmp`` in the compiled planner when they share a dtype (int32 or int64) and
    are C-contiguous, else ``np.array_equal``."""
    if a.shape != b.shape:
        return False
    if (a.dtype == b.dtype and a.dtype in _ID_DTYPES and a.flags.c_contiguous
            and b.flags.c_contiguous and implementation() == "cython"):
        return bool(_compiled.same_ids(a.reshape(-1), b.reshape(-1)))
    return bool(np.array_equal(a, b))


_ID_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def _first_repeat_numpy(flat: np.ndarray) -> int:
    """Pure-numpy twin of :func:`stpipe._planner.first_repeat`."""
    if flat.shape[0] < 2:
        return -1
    order = np.argsort(flat, kind="stable")
    ordered = flat[order]
    again = ordered[1:] == ordered[:-1]
    if not again.any():
        return -1
    return int(order[1:][again].min())


def first_repeat(ids: Any, num_rows: int) -> int:
    """Position (in ``ids`` flattened) of the first id that occurred earlier, or -1.

    A duplicate check in O(n) with a bitmap of ``num_rows`` bits (the compiled planner;
    its numpy twin sorts). The ids are range-checked first.

    Raises:
        StpipeIndexError, StpipeTypeError: as :func:`check_ids`.
    """
    arr = check_ids(ids, num_rows)
    flat = arr.reshape(-1)
    if flat.shape[0] < 2:
        return -1
    if implementation() == "cython":
        need = (int(num_rows) + 7) // 8
        seen = getattr(_scratch, "bitmap", None)
        if seen is None or seen.shape[0] < need:
            seen = np.zeros(need, dtype=np.uint8)
            _scratch.bitmap = seen
        return int(_compiled.first_repeat(flat, seen))
    return _first_repeat_numpy(flat)


#: per-thread scratch of :func:`first_repeat` (a zeroed bitmap, zeroed again after use)
_scratch = threading.local()


def _plan_numpy(flat: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pure-numpy twin of :func:`stpipe._planner.plan_unchecked` (stable argsort)."""
    n = flat.shape[0]
    if n == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty.copy(), empty.copy()
    order = np.argsort(flat, kind="stable")
    ordered = flat[order].astype(np.int64, copy=False)
    starts = np.empty(n, dtype=bool)
    starts[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=starts[1:])
    unique = ordered[starts]
    group = np.cumsum(starts, dtype=np.int64) - 1
    inverse = np.empty(n, dtype=np.int64)
    inverse[order] = group
    first = np.flatnonzero(starts)
    counts = np.diff(np.append(first, n)).astype(np.int64)
    return unique, inverse, counts


def plan(ids: Any, num_rows: int) -> Plan:
    """Plan one batch: validate, deduplicate, sort, invert.

    Args:
        ids: row ids of any shape: numpy array, torch tensor, list; int32 or int64
            (other integer dtypes are widened). Non-contiguous input is fine.
        num_rows: the table's row count; every id must be in ``[0, num_rows)``.

    Returns:
        A :class:`Plan`; an empty batch gives an empty plan.

    Raises:
        StpipeTypeError: float/bool ids, or a non-integer ``num_rows``.
        StpipeValueError: ``num_rows <= 0``.
        StpipeIndexError: an out-of-range id (the first one and its position).
    """
    num_rows = _check_num_rows(num_rows)
    arr = as_index_array(ids)
    flat = arr.reshape(-1)
    if implementation() == "cython":
        # range check and plan in one compiled call; an int result is the first bad position
        res = _compiled.plan_checked(flat, num_rows)
        if type(res) is not tuple:
            _raise_out_of_range(arr, flat, res, num_rows)
        unique, inverse, counts = res
    else:
        pos = _first_out_of_range_numpy(flat, num_rows)
        if pos >= 0:
            _raise_out_of_range(arr, flat, pos, num_rows)
        unique, inverse, counts = _plan_numpy(flat, num_rows)
    if arr.ndim != 1:
        inverse = inverse.reshape(arr.shape)
    return Plan(unique=unique, inverse=inverse, counts=counts, num_rows=num_rows)


def _intersect_numpy(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    _, pa, pb = np.intersect1d(a, b, assume_unique=True, return_indices=True)
    return pa.astype(np.int64), pb.astype(np.int64)


def overlap(prev: Plan, next: Plan) -> tuple[np.ndarray, np.ndarray]:  # noqa: A002
    """Rows two plans share, by sorted-merge intersection of their ``unique`` ids.

    Args:
        prev: the earlier batch's plan.
        next: the later batch's plan (same table).

    Returns:
        ``(prev_pos, next_pos)``: ``(m,)`` int64 each, ascending, with
        ``prev.unique[prev_pos] == next.unique[next_pos]``.

    Raises:
        StpipeTypeError: an argument is not a :class:`Plan`.
        StpipeValueError: the plans were made for tables of different row counts.
    """
    for name, p in (("prev", prev), ("next", next)):
        if not isinstance(p, Plan):
            raise StpipeTypeError(f"{name} must be a Plan, got {type(p).__name__}")
    if prev.num_rows != next.num_rows:
        raise StpipeValueError(
            f"plans are for different tables: prev.num_rows={prev.num_rows}, "
            f"next.num_rows={next.num_rows}"
        )
    if implementation() == "cython":
        return _compiled.intersect_sorted(prev.unique, next.unique)
    return _intersect_numpy(prev.unique, next.unique)


def _ensure_plan(ids_or_plan: Any, num_rows: Optional[int]) -> Plan:
    """Return ``ids_or_plan`` if it is a Plan, else plan it (internal helper)."""
    if isinstance(ids_or_plan, Plan):
        return ids_or_plan
    if num_rows is None:
        raise StpipeValueError("num_rows is needed to plan raw ids")
    return plan(ids_or_plan, num_rows)

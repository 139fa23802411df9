"""The one exception family of stpipe.

Every error stpipe raises on bad input is a subclass of :class:`StpipeError` *and* of
the builtin kind a PyTorch user would catch (``IndexError``, ``ValueError``,
``TypeError``, ``RuntimeError``), so ``except IndexError`` keeps working.
Messages say what was expected, what was got, and the fix.
"""
from __future__ import annotations

__all__ = [
    "StpipeError",
    "StpipeIndexError",
    "StpipeValueError",
    "StpipeTypeError",
    "StpipeRuntimeError",
    "BackendUnavailableError",
]


class StpipeError(Exception):
    """Base class of every stpipe error."""


class StpipeIndexError(StpipeError, IndexError):
    """A row id outside ``[0, num_rows)``."""


class StpipeValueError(StpipeError, ValueError):
    """A value of the right type but the wrong shape, size or content."""


class StpipeTypeError(StpipeError, TypeError):
    """A value of the wrong type or dtype."""


class StpipeRuntimeError(StpipeError, RuntimeError):
    """A failure at run time: a closed table, a failed prefetch thread, ..."""


class BackendUnavailableError(StpipeError, RuntimeError):
    """An optional backend (CuPy, numba-cuda, CUDA itself) cannot be used here."""

"""stpipe: train embedding tables far larger than GPU memory.

Tables and their optimizer state live in pinned host RAM; each step only the rows a
batch touches travel to the GPU and back, through a prefetch pipeline that overlaps the
next batch's transfer with this batch's compute. CuPy and numba-cuda are optional and
imported lazily; ``import stpipe`` never imports them.
"""
from __future__ import annotations

from ._errors import (
    BackendUnavailableError,
    StpipeError,
    StpipeIndexError,
    StpipeRuntimeError,
    StpipeTypeError,
    StpipeValueError,
)
from . import checkpoint
from .embedding import HostEmbedding
from .host import HostTable
from .loader import Prefetcher, prefetch
from .pipeline import Pipeline, Step
from .planner import Plan, overlap, plan

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "HostTable",
    "HostEmbedding",
    "Pipeline",
    "Step",
    "prefetch",
    "Prefetcher",
    "checkpoint",
    "Plan",
    "plan",
    "overlap",
    "StpipeError",
    "StpipeIndexError",
    "StpipeValueError",
    "StpipeTypeError",
    "StpipeRuntimeError",
    "BackendUnavailableError",
]

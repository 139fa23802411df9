"""The ``auto`` backend (first version: delegates to the torch backend)."""
from __future__ import annotations

from ._torch import TorchBackend

__all__ = ["AutoBackend"]


class AutoBackend(TorchBackend):
    """Placeholder: the torch backend until measurement-based choice lands."""

    name = "auto"

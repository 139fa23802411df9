"""Compatibility layers for code written against stpipe's predecessors.

* :mod:`stpipe.compat.speedtorch`: the SpeedTorch 0.1.6 API (``ModelFactory``,
  ``OptimizerFactory``, ``DataGadget``, ...). Existing code switches with one line::

      import stpipe.compat.speedtorch as SpeedTorch

Nothing here is imported by ``import stpipe``; the core never imports compat.
"""
from __future__ import annotations

__all__ = ["speedtorch"]


def __getattr__(name: str):
    # `from stpipe.compat import speedtorch` and `stpipe.compat.speedtorch` work without
    # importing the module at `import stpipe.compat`.
    if name == "speedtorch":
        import importlib

        return importlib.import_module(".speedtorch", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Making a CUDA stream current with few Python calls (private).

``torch.cuda.stream(s)`` resolves the current device and builds ``Stream`` objects in
Python on entry and exit (in the pipeline's cProfile on the H200 host: 740 contexts, 1,631
``_get_device_index`` calls in 150 steps). :class:`on_stream` does the common case, ``s``
on the current device, with one read and two writes of the current stream through
PyTorch's own bindings, and defers to ``torch.cuda.stream`` for anything else.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

__all__ = ["on_stream", "current_stream"]

_get = getattr(torch._C, "_cuda_getCurrentStream", None)
_set = getattr(torch._C, "_cuda_setStream", None)


_last: "dict[int, Tuple[Tuple[int, int, int], torch.cuda.Stream]]" = {}


def current_stream(device: torch.device) -> "torch.cuda.Stream":
    """``torch.cuda.current_stream(device)`` (``device.index`` set), reusing the ``Stream``
    object of the previous call when the current stream has not changed."""
    idx = device.index
    if _get is None or idx is None:
        return torch.cuda.current_stream(device)
    raw = _get(idx)
    hit = _last.get(idx)
    if hit is not None and hit[0] == raw:
        return hit[1]
    s = torch.cuda.Stream(stream_id=raw[0], device_index=raw[1], device_type=raw[2])
    _last[idx] = (raw, s)
    return s


class on_stream:
    """``with on_stream(s):`` makes ``s`` the current stream of its device for the block,
    like ``torch.cuda.stream(s)`` (the previous stream is restored on exit)."""

    __slots__ = ("_s", "_prev", "_ctx")

    def __init__(self, stream: "torch.cuda.Stream") -> None:
        self._s = stream
        self._prev: Optional[Tuple[int, int, int]] = None
        self._ctx: Any = None

    def __enter__(self) -> "torch.cuda.Stream":
        s = self._s
        if _get is None or _set is None or s.device_index != torch.cuda.current_device():
            self._ctx = torch.cuda.stream(s)
            self._ctx.__enter__()
            return s
        prev = _get(s.device_index)
        sid, idx, typ = s.stream_id, s.device_index, s.device_type
        if prev[0] == sid and prev[1] == idx and prev[2] == typ:
            return s  # already current: nothing to set, nothing to restore
        self._prev = prev
        _set(stream_id=sid, device_index=idx, device_type=typ)
        return s

    def __exit__(self, *exc: Any) -> bool:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
            return False
        p = self._prev
        if p is not None:
            _set(stream_id=p[0], device_index=p[1], device_type=p[2])
        return False

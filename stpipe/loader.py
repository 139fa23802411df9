"""Wrap a data loader so that its batches reach the device ahead of use.

:func:`prefetch` takes any iterable of batches (a ``DataLoader``, its iterator, a
generator) and yields the same batches with every tensor already on ``device``. A named
daemon thread pulls batch N+1 from the loader, pins it if needed and copies it on a
dedicated copy stream while the training thread computes on batch N::

    for batch in stpipe.prefetch(loader, "cuda", depth=2):
        loss = model(batch["x"]).loss(batch["y"])   # batch is already on the GPU
        ...

Batches may be tensors or any nesting of dicts (and other mappings), lists, tuples,
namedtuples and dataclasses; other leaves pass through unchanged. :func:`_map_tensors`
is the traversal, shared with :mod:`stpipe.pipeline`.

Stream contract (CUDA):

* **Copy stream.** Each :class:`Prefetcher` owns one ``torch.cuda.Stream(device)``. The
  thread issues every host-to-device copy there with ``non_blocking=True``; the device
  tensors are allocated on that stream. A pinned source is copied as it is; a pageable
  one is first pinned by the thread (``Tensor.pin_memory()``, a CPU copy into the caching
  host allocator, which itself keeps the pinned block alive until the copy stream is past
  the copy, through an event it records). So give the ``DataLoader`` ``pin_memory=True``
  to keep that CPU copy out of this thread.
* **Events.** The thread records one ``torch.cuda.Event`` per batch on the copy stream
  after its copies and queues the batch at once; it never waits on the GPU, so the
  copies of all queued batches sit on the copy stream back to back.
* **Hand-out.** When :meth:`Prefetcher.__next__` hands batch N to the caller it first
  waits on N's event on the host (``Event.synchronize``, GIL released; N's copy was
  issued up to ``depth`` batches earlier, so in the steady state it is long done and
  this costs microseconds). Hence every batch handed out is *complete*: the loader's
  source tensors may be modified or reused as soon as their batch has been handed out
  (not before: a loader must not overwrite a tensor it yielded while that batch is
  still queued). Then the caller's current stream on ``device`` waits on N's event
  (``current_stream.wait_event``) and every tensor the copy made is ``record_stream``-ed
  on that stream, so the caching allocator does not give their memory to a later copy
  while work queued on the consumer's stream still reads them. Tensors already on
  ``device`` pass through untouched (no copy, no record).
* **Memory bound.** At most ``depth`` batches wait in the queue, plus one the thread is
  preparing (or waiting to queue), plus the one the caller holds.

On a CPU target (``device="cpu"``, or any device when CUDA is unavailable) the same
thread runs with no copies and no streams: batches pass through unchanged (a tensor
elsewhere is moved with a blocking ``.to(device)``), so the loader still runs ahead of
the training step. The behaviour around the thread (``len``, close, errors) is the same
on every device.

Closing: leave the loop with ``break`` (the iterator is collected), call
:meth:`Prefetcher.close`, use it as a context manager, or drop it: each stops the thread
(stop event), joins it with a timeout, drops the queued batches and waits for the copy
stream, so no thread and no pinned or device memory outlives the iterator.

Errors: an exception raised by the loader (or by a copy) in the thread is delivered at
the batch where it happened, after the batches before it, as
:class:`~stpipe.StpipeRuntimeError` chained (``__cause__``) to the original exception,
which keeps its traceback from the thread and gets a note saying where it was raised.
"""
from __future__ import annotations

import collections.abc
import copy
import dataclasses
import itertools
import queue
import threading
import warnings
import weakref
from typing import Any, Callable, Generic, Iterable, Iterator, List, Optional, TypeVar, Union

import torch

from ._errors import StpipeRuntimeError, StpipeTypeError, StpipeValueError

__all__ = ["prefetch", "Prefetcher"]

T = TypeVar("T")

DeviceLike = Union[str, int, torch.device, None]

#: Seconds :meth:`Prefetcher.close` waits for the thread before warning.
_JOIN_TIMEOUT_S = 5.0
#: Poll interval (s) of the blocking queue operations, i.e. the latency of a stop.
_POLL_S = 0.05


def _put_unless_stopped(q: "queue.Queue[Any]", item: Any, stop: threading.Event) -> bool:
    """Put ``item`` into the bounded ``q``, waiting for room, polling ``stop`` every
    ``_POLL_S``; ``False`` if ``stop`` was set first. (The pipeline's queues are bounded by
    its staging slots instead and never wait for room: ``stpipe.pipeline._Run``.)"""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False
_thread_ids = itertools.count()


# --------------------------------------------------------------------------- traversal


def _copy_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` by a non-blocking copy on the current stream; a pageable CPU
    tensor is pinned first (a CPU copy into the caching host allocator), so the copy is
    asynchronous and the pinned source lives until the copy has run."""
    if t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """Apply ``fn`` to every tensor leaf of a nested batch, keeping the structure.

    Containers are rebuilt with their own type: ``dict`` and other mappings (a ``dict``
    subclass or ``UserDict`` is copied and updated, so ``defaultdict``/``OrderedDict``
    keep their extras; another mapping is ``type(x)(items)``, or a plain ``dict`` where
    its constructor does not take one, since its copy may share its items), ``list`` (subclasses are shallow-copied and assigned item by item),
    ``tuple``, namedtuples (``type(x)(*fields)``) and dataclass instances (shallow copy,
    then every field set with ``object.__setattr__``, so frozen and ``init=False``
    fields work and ``__init__``/``__post_init__`` are not run again). Every other leaf
    (numbers, strings, ``None``, numpy arrays, ...) is returned as it is. The input is
    never modified.

    Args:
        fn: the function applied to each ``torch.Tensor`` leaf; its result replaces it.
        batch: a tensor, a leaf, or a nesting of the containers above.

    Returns:
        A batch of the same structure with ``fn(t)`` in place of every tensor ``t``.
    """
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if type(batch) is dict:  # the usual batch: no dataclass or ABC checks
        return {key: _map_tensors(fn, value) for key, value in batch.items()}
    if isinstance(batch, (str, bytes, bytearray)):
        return batch
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        clone = copy.copy(batch)
        for field in dataclasses.fields(batch):
            try:
                value = getattr(batch, field.name)
            except AttributeError:  # an init=False field never set
                continue
            object.__setattr__(clone, field.name, _map_tensors(fn, value))
        return clone
    if isinstance(batch, collections.abc.Mapping):
        items = {key: _map_tensors(fn, value) for key, value in batch.items()}
        if type(batch) is dict:
            return items
        try:
            if isinstance(batch, (dict, collections.UserDict)):  # their copies own their items
                clone = copy.copy(batch)
                clone.update(items)
                return clone
            return type(batch)(items)  # type: ignore[call-arg]
        except TypeError:  # no copy/update/constructor from a dict
            return items
    if isinstance(batch, tuple):
        values = [_map_tensors(fn, value) for value in batch]
        if type(batch) is tuple:
            return tuple(values)
        if hasattr(batch, "_fields"):  # namedtuple
            return type(batch)(*values)
        try:
            return type(batch)(values)  # type: ignore[call-arg]
        except TypeError:
            return tuple(values)
    if isinstance(batch, list):
        values = [_map_tensors(fn, value) for value in batch]
        if type(batch) is list:
            return values
        try:
            clone = copy.copy(batch)
            clone[:] = values
            return clone
        except TypeError:
            return values
    return batch


# --------------------------------------------------------------------------- helpers


def _resolve_device(device: DeviceLike) -> torch.device:
    """Return the concrete target device (CUDA index filled in, CPU when no CUDA).

    Raises:
        StpipeTypeError: ``device`` is not a str, int, ``torch.device`` or ``None``.
        StpipeValueError: a device string torch does not know.
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise StpipeTypeError(
            f"device must be a str, int or torch.device (e.g. 'cuda', 0, "
            f"torch.device('cuda', 0)), got {type(device).__name__}: {device!r}"
        )
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except RuntimeError as exc:
        raise StpipeValueError(f"device must be a CUDA device or 'cpu', got {device!r} ({exc})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            warnings.warn(
                f"stpipe.prefetch: CUDA is not available, so batches stay on the CPU "
                f"instead of going to {dev}",
                RuntimeWarning,
                stacklevel=4,  # the caller of prefetch()
            )
            return torch.device("cpu")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type == "cpu":
        dev = torch.device("cpu")  # "cpu:0" too: CPU tensors report plain "cpu"
    return dev


def _check_depth(depth: Any) -> int:
    """Validate ``depth``.

    Raises:
        StpipeTypeError: ``depth`` is not an int.
        StpipeValueError: ``depth < 1``.
    """
    if isinstance(depth, bool) or not isinstance(depth, int):
        raise StpipeTypeError(f"depth must be an int >= 1, got {type(depth).__name__}: {depth!r}")
    if depth < 1:
        raise StpipeValueError(
            f"depth must be >= 1 (the number of batches prepared ahead), got {depth}; "
            "use depth=1 for one batch ahead or iterate the loader directly for none"
        )
    return depth


class _Batch:
    """A batch ready to hand out: the moved batch, the tensors the copy made, its event."""

    __slots__ = ("index", "batch", "copies", "event")

    def __init__(
        self,
        index: int,
        batch: Any,
        copies: List[torch.Tensor],
        event: Optional[torch.cuda.Event],
    ) -> None:
        self.index = index
        self.batch = batch
        self.copies = copies
        self.event = event


class _Failure:
    """An exception the thread caught, with where it was raised."""

    __slots__ = ("exc", "index", "where")

    def __init__(self, exc: BaseException, index: int, where: str) -> None:
        self.exc = exc
        self.index = index
        self.where = where


_END = object()  # the loader is exhausted


class _State:
    """What the thread and the finalizer share; never refers to the :class:`Prefetcher`.

    Keeping the thread's references here (and not on the iterator) lets the iterator be
    garbage collected while the thread runs, which is what closes it on GC.
    """

    def __init__(self, device: torch.device, depth: int) -> None:
        self.device = device
        self.queue: "queue.Queue[Any]" = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread: Optional[threading.Thread] = None
        self.source: Optional[Iterator[Any]] = None
        self.copy_stream: Optional[torch.cuda.Stream] = None

    def put(self, item: Any) -> bool:
        """Queue ``item``, waiting for room; return ``False`` if stopped first."""
        return _put_unless_stopped(self.queue, item, self.stop)


def _shutdown(state: _State) -> None:
    """Stop the thread, join it with a timeout, drop queued batches, drain the copy stream.

    Safe to call more than once, from :meth:`Prefetcher.close`, a ``with`` exit or the
    GC finalizer (possibly on the prefetch thread itself, which then is not joined).
    """
    state.stop.set()
    thread = state.thread
    alive = False
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=_JOIN_TIMEOUT_S)
        alive = thread.is_alive()
        if alive:
            warnings.warn(
                f"stpipe.prefetch: thread {thread.name!r} did not stop within "
                f"{_JOIN_TIMEOUT_S:.0f} s (it is blocked in the loader's next()); it is a "
                "daemon and exits once that call returns",
                RuntimeWarning,
                stacklevel=2,
            )
    while True:  # drop queued batches (device tensors, pinned staging via their events)
        try:
            state.queue.get_nowait()
        except queue.Empty:
            break
    if state.copy_stream is not None and not alive:
        try:  # copies still reading user memory are done before close returns
            state.copy_stream.synchronize()
        except Exception:  # pragma: no cover - e.g. CUDA already torn down at exit
            pass


# --------------------------------------------------------------------------- thread


def _worker(state: _State) -> None:
    """The prefetch thread: fetch, pin, issue the copies on the copy stream, queue.

    Stream contract: copies and the device allocations run on ``state.copy_stream``; one
    event per batch is recorded there after its copies; the thread never waits on the
    GPU, so the copy stream always holds the copies of every queued batch and the copy
    engine is not left idle while the thread is in the loader. On a CPU target no
    stream or event is used. A batch is queued as soon as its copies are issued (never
    held back while the loader produces the next one, so a loader that waits on the
    consumer cannot deadlock). Every exception is queued as a :class:`_Failure` after
    the batches before it; ``_END`` marks exhaustion.
    """
    device = state.device
    stream = state.copy_stream
    source = state.source
    index = 0
    try:
        while not state.stop.is_set():
            try:
                raw = next(source)  # type: ignore[arg-type]
            except StopIteration:
                state.put(_END)
                return
            except BaseException as exc:  # noqa: BLE001 - delivered to the training thread
                state.put(_Failure(exc, index, "fetching it from the loader"))
                return
            try:
                ready = _move(raw, index, device, stream)
            except BaseException as exc:  # noqa: BLE001
                state.put(_Failure(exc, index, f"copying it to {device}"))
                return
            del raw
            if not state.put(ready):
                return
            del ready
            index += 1
    finally:
        state.source = None  # let a DataLoader iterator we made shut its workers down


def _move(
    batch: Any, index: int, device: torch.device, stream: Optional[torch.cuda.Stream]
) -> _Batch:
    """Start moving ``batch`` to ``device``; return it with the copies and their event.

    Stream contract: with a CUDA target, pinning happens on this thread (CPU), the copies
    are issued with ``non_blocking=True`` on ``stream`` (which also owns the new device
    memory) and an event is recorded on ``stream`` after them; nothing waits here. A
    tensor already on ``device`` is passed through; a tensor seen twice in one batch is
    copied once (aliasing is kept).
    """
    copies: List[torch.Tensor] = []
    if stream is None:  # CPU target: no copy for CPU tensors, blocking .to otherwise
        moved = _map_tensors(lambda t: t if t.device == device else t.to(device), batch)
        return _Batch(index, moved, copies, None)

    seen: dict = {}

    def to_device(t: torch.Tensor) -> torch.Tensor:
        if t.device == device:
            return t
        hit = seen.get(id(t))
        if hit is not None:
            return hit
        out = _copy_to(t, device)
        seen[id(t)] = out
        copies.append(out)
        return out

    with torch.cuda.device(device), torch.cuda.stream(stream):
        moved = _map_tensors(to_device, batch)
        event = torch.cuda.Event()
        event.record(stream)
    return _Batch(index, moved, copies, event)


# --------------------------------------------------------------------------- iterator


class Prefetcher(Generic[T]):
    """An iterator over a loader's batches, moved to a device ahead of use.

    Made by :func:`prefetch`; see the module docstring for the stream contract. The
    thread starts at the first ``next()``; one pass only (wrap the loader again for the
    next epoch). Closing it (``close()``, ``with``, ``break`` + collection, GC) stops and
    joins the thread and frees what it holds.
    """

    def __init__(self, loader: Iterable[T], device: DeviceLike = None, depth: int = 2) -> None:
        """Check the arguments; start nothing yet.

        Args:
            loader: any iterable of batches (``DataLoader``, iterator, generator).
            device: target device; ``None`` means the current CUDA device, else CPU.
            depth: how many batches may wait in the queue (>= 1).

        Raises:
            StpipeTypeError: ``loader`` is not iterable, or a bad ``device``/``depth`` type.
            StpipeValueError: ``depth < 1``, or a device string torch does not know.
        """
        if not isinstance(loader, collections.abc.Iterable) and not hasattr(loader, "__getitem__"):
            raise StpipeTypeError(
                "prefetch needs an iterable of batches (a DataLoader, an iterator or a "
                f"generator), got {type(loader).__name__}"
            )
        self._depth = _check_depth(depth)
        self._device = _resolve_device(device)
        self._loader = loader
        self._state = _State(self._device, self._depth)
        self._finalizer = weakref.finalize(self, _shutdown, self._state)
        self._started = False
        self._done = False

    @property
    def device(self) -> torch.device:
        """The device the batches are moved to (``cpu`` when CUDA is unavailable)."""
        return self._device

    @property
    def depth(self) -> int:
        """The queue bound given at construction."""
        return self._depth

    @property
    def thread(self) -> Optional[threading.Thread]:
        """The prefetch thread, ``None`` before the first ``next()``."""
        return self._state.thread

    def __len__(self) -> int:
        """Return ``len(loader)``.

        Raises:
            TypeError: the loader has no ``len()`` (a generator, say).
        """
        try:
            return len(self._loader)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"the wrapped loader ({type(self._loader).__name__}) has no len()"
            ) from None

    def __iter__(self) -> "Prefetcher[T]":
        return self

    def _start(self) -> None:
        """Make the source iterator (on this thread) and start the prefetch thread."""
        state = self._state
        state.source = iter(self._loader)
        if self._device.type == "cuda":
            state.copy_stream = torch.cuda.Stream(self._device)
        name = f"stpipe-prefetch-{next(_thread_ids)}"
        state.thread = threading.Thread(target=_worker, args=(state,), name=name, daemon=True)
        state.thread.start()
        self._started = True

    def __next__(self) -> T:
        """Hand out the next batch, ordered on the caller's current stream.

        Stream contract: the host waits on the batch's copy event (usually long done),
        then the caller's current stream on ``device`` waits on it too and each copied
        tensor is ``record_stream``-ed on that stream.

        Returns:
            The batch, with its tensors on ``device``.

        Raises:
            StopIteration: the loader is exhausted, or the iterator is closed.
            StpipeRuntimeError: the loader (or a copy) raised at this batch; the original
                exception is its ``__cause__``.
        """
        if self._done:
            raise StopIteration
        if not self._started:
            self._start()
        state = self._state
        thread = state.thread
        while True:
            try:
                item = state.queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if self._done:  # closed from another thread meanwhile
                    raise StopIteration from None
                if thread is not None and not thread.is_alive() and state.queue.empty():
                    self.close()
                    raise StpipeRuntimeError(
                        f"stpipe.prefetch: thread {thread.name!r} ended without a result; "
                        "was the iterator closed from another thread?"
                    ) from None
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            self._raise(item, thread)
        ready: _Batch = item
        if ready.event is not None:
            ready.event.synchronize()  # host wait, GIL released; long done in steady state
            consumer = torch.cuda.current_stream(self._device)
            consumer.wait_event(ready.event)
            for t in ready.copies:
                t.record_stream(consumer)
        return ready.batch

    @staticmethod
    def _raise(failure: _Failure, thread: Optional[threading.Thread]) -> None:
        """Re-raise a thread's exception as StpipeRuntimeError chained to it."""
        exc = failure.exc
        name = thread.name if thread is not None else "?"
        where = f"batch {failure.index} (0-based), while {failure.where}"
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(f"[stpipe.prefetch] raised in thread {name!r} at {where}")
        if not isinstance(exc, Exception):  # SystemExit and friends keep their kind
            raise exc
        raise StpipeRuntimeError(
            f"stpipe.prefetch: {type(exc).__name__}: {exc} -- raised in thread {name!r} "
            f"at {where}; the batches before it were delivered. The original exception "
            "and its traceback are chained above (__cause__)."
        ) from exc

    def close(self) -> None:
        """Stop and join the thread, drop the queued batches, wait for the copy stream.

        Idempotent; afterwards ``next()`` raises ``StopIteration``. If the thread is
        blocked inside the loader for longer than the join timeout a ``RuntimeWarning``
        is issued (the daemon thread exits once that call returns).
        """
        self._done = True
        self._finalizer()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (or the loader is exhausted)."""
        return self._done

    def __enter__(self) -> "Prefetcher[T]":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._done else ("running" if self._started else "not started")
        return (
            f"Prefetcher(loader={type(self._loader).__name__}, device={self._device}, "
            f"depth={self._depth}, {state})"
        )


def prefetch(loader: Iterable[T], device: DeviceLike, depth: int = 2) -> Prefetcher[T]:
    """Iterate ``loader`` with each batch already moved to ``device``.

    A named daemon thread fetches batches ahead (at most ``depth`` wait in its queue),
    pins pageable CPU tensors, copies them with ``non_blocking=True`` on a dedicated copy
    stream and records an event per batch; when a batch is handed out its copy is
    complete (host wait on the event), the caller's current stream waits on the event
    and the tensors are ``record_stream``-ed on it (full contract in the module
    docstring). On a CPU target the thread runs without
    copies and batches pass through unchanged.

    Args:
        loader: any iterable of batches: a ``DataLoader`` (``pin_memory=True`` spares
            the thread the pinning copy), its iterator, a generator. Batches are tensors
            or nestings of dicts, lists, tuples, namedtuples and dataclasses; non-tensor
            leaves pass through unchanged.
        device: where the tensors go: ``"cuda"``, ``"cuda:1"``, an int, a
            ``torch.device``, ``"cpu"``; ``None`` for the current CUDA device (CPU when
            CUDA is unavailable). A CUDA device on a machine without CUDA warns and
            degrades to the CPU.
        depth: how many batches may wait ahead of the training step (>= 1).

    Returns:
        A one-pass :class:`Prefetcher`: an iterator with ``len()`` when the loader has
        one, ``close()`` and context-manager support.

    Raises:
        StpipeTypeError: ``loader`` is not iterable, or ``device``/``depth`` has the
            wrong type.
        StpipeValueError: ``depth < 1``, or a device string torch does not know.

    Errors of the loader surface from ``next()`` at the batch where they happened, as
    :class:`~stpipe.StpipeRuntimeError` whose ``__cause__`` is the original exception.
    """
    return Prefetcher(loader, device, depth)

"""The training pipeline: prefetch thread, staging buffers, hazard fix-up, the step context.

::

    emb = stpipe.HostEmbedding(num_rows=10_000_000, dim=128)
    opt = torch.optim.Adam(emb.parameters(), lr=1e-3)
    with stpipe.Pipeline(emb, optimizer=opt, ids=lambda b: b["ids"]) as pipe:
        for step in pipe.run(loader):          # batch N+1 is planned and gathered meanwhile
            with step:                         # waits for this step's rows only
                loss = model(emb(step.ids), step.batch)
                loss.backward(); opt.step(); opt.zero_grad()
            # leaving the block wrote the rows and optimizer state back (asynchronously)

Several tables: ``Pipeline({"in": emb_in, "out": emb_out}, optimizer=opt,
ids=lambda b: {"in": b["centre"], "out": b["context"]})``; ``step.ids`` is then a dict.
A table's ids may also be a tuple/list of id tensors (several fields, one table): they are
planned together and ``emb(part)`` works for each part.

How a batch travels (depth ``d >= 1``; ``S = d + 1`` slots of staging buffers per table)
-------------------------------------------------------------------------------------

1. The prefetch thread (named ``stpipe-prefetch-<n>``, daemon) reads batch ``j`` from the
   iterable, calls ``ids``, plans every table (the Cython planner releases the GIL), and
   takes a free slot (a bounded queue of ``S`` slot numbers: at most ``d`` batches are
   gathered ahead of the one being trained).
   With ``STPIPE_PREFETCH_GATE=1`` (an experiment; off by default) it then waits at a
   *gate* until the training thread has begun step ``j - d`` (its first embedding lookup)
   or left it, so the GIL-bound part of issuing ``j`` runs while that step's backward runs
   (the training thread waits there without the GIL) instead of during the step's entry
   and forward. Ordering only: no result depends on it. On the H200 it helped at 2M rows
   in one process and slowed the 10M-row skip-gram benchmark (benchmarks/RESULTS.md).
   With the same aim, ``Pipeline(prefetch_delay=...)`` makes it wait after the slot it
   takes was freed (the start of step ``j - d``): by default (``"auto"``, on CUDA) 0.3 of
   the recent step period, capped so that the issue still ends well before the step does
   (:func:`_auto_delay`); or a fixed number of seconds; or not at all (``0``). The issue
   then runs while the step's ``backward()`` waits without the GIL rather than during its
   entry and forward pass, which need the GIL too. Timing only: no result depends on it.
   (The backward is not free of the GIL: autograd's thread takes it to release each saved
   tensor Python has seen. The lookups' index tensors and outputs are held until the
   step's exit, so their releases take none; see :func:`_make_hold`.)
2. It takes a snapshot of the batches *in flight* (gathered and not yet finished) and
   computes the planner's ``overlap`` of ``j`` with each of them, off the lock. Then one
   asynchronous copy on the copy stream, through the pipeline's own pinned upload ring,
   moves everything ``j`` needs on the device: each table's inverse and unique ids, the
   overlaps, and the batch's own CPU tensors (packed and copied in one release of the GIL;
   the tensor views of one dtype made by one call, :meth:`Pipeline._upload_lean`).
3. Under the pipeline's *issue lock* it gathers ``j``'s unique rows (and the per-row
   optimizer state known so far) from the host tables into slot buffers on the copy
   stream, records ``j.ready`` there (one event, also the tables' read event, the batch's
   event and the guard of its ring region), and adds
   ``j`` to the in-flight set. A slot holds a
   table's rows and state as one ``(1 + keys, cap, dim)`` stack, so one fused UVA launch
   gathers them all (a move prepared once per slot stack, :func:`stpipe.host._prepare_move`;
   :func:`stpipe.host.gather_many` where CuPy cannot run), and one launch of the carry
   kernel (else an ``index_select`` / ``index_copy_`` pair) does a fix-up (5a). Unique ids
   and overlaps reach those kernels by device address; only the inverses and the batch's
   tensors get tensor views.
4. The training thread, entering step ``j``, makes its current (compute) stream wait for
   ``j.ready`` (no host synchronisation), points ``emb.weight.data`` and
   ``optimizer.state[weight][key]`` at views ``buf[:k]`` of the slot, and runs the user's
   code. The views and the embeddings' lookup bindings were made with the gather (step 3,
   in the prefetch thread), so entry only installs them.
5. Leaving step ``i`` normally, the training thread records ``done`` on the compute stream,
   and under the issue lock, on the copy stream after ``done``: (a) for every batch ``j > i``
   in flight (already gathered), copies the rows (and state) the two batches share from
   ``i``'s slot into ``j``'s slot, device to device, and re-records ``j.ready``; (b) scatters
   ``i``'s rows and state to the host tables; then frees ``i``'s slot.

Why this gives the sequential result (semantics 1 and 2). Claim: when step ``j`` starts, every
row ``r`` in ``j``'s slot holds the value written by the last *successful* step ``i* < j``
that touched ``r`` (or the host value if none did). Because gathers (3) and write-backs (5)
are issued under one lock and run in issue order on one copy stream (the host table also
orders its own CPU reads after earlier scatters), either (a) ``j`` was gathered after ``i*``
left: the gather reads the host after ``i*``'s scatter, and no later step before ``j``
touches ``r``, so nothing overwrites it; or (b) ``j`` was gathered before ``i*`` left: then
``j`` was in flight when ``i*`` left, so 5(a) copied ``r`` from ``i*``'s slot, which by
induction held ``r`` as of the step before ``i*`` plus ``i*``'s own update; copies from
earlier steps came before it in stream order and no later step before ``j`` touches ``r``.
This holds for any depth: a batch ``j`` in flight receives the fix-up of every batch that
leaves while ``j`` waits. A slot is reused only after the step that used it left, and its
next gather is stream-ordered after that step's compute (``done``), fix-ups and scatter.
The tests check it bit for bit: depth 0 vs 1 vs 2, every optimizer, adversarial ids.

Failure (semantics 5). Leaving a step by exception issues no fix-up and no scatter; the
slot is freed (the copy stream still waits for the failed step's compute before reusing
it). By the claim above, batches in flight keep the values of the last successful step, and
the host tables are unchanged. The optimizer's scalar state (``step``, ASGD's ``eta``/``mu``,
NAdam's ``mu_product``) is restored to its value at step entry and ``weight.grad`` is
cleared; other parameters of the user's model (dense layers) are the user's business.
Errors in the prefetch thread (the iterable, ``ids``, planning, a gather) are re-raised in
the training thread, in batch order, with a note naming the thread and what it was doing
(same exception object and type; Python 3.10 gets a :class:`~stpipe.StpipeRuntimeError`
wrapping it). The run then ends; the pipeline can start another run or close.

Batches and checkpoints. ``run`` copies each batch's tensors to the device on the copy
stream ahead of its step (see :meth:`Pipeline.run`). :meth:`Pipeline.save_checkpoint` /
:meth:`Pipeline.load_checkpoint` (and ``state_dict`` / ``load_state_dict``) save and
restore tables, per-row and scalar optimizer state between steps, also with batches in
flight (it waits for the write-backs); see :mod:`stpipe.checkpoint`.

Depth 0 is the strict sequence (plan, gather, step, scatter, next) in the training thread,
the reference of the tests.

Streams. On CUDA: one copy stream per pipeline for gathers, fix-ups and scatters; the
training thread's current stream at step entry is the compute stream. Staging buffers are
persistent (grown on demand, capacity from the largest batch); a replaced buffer is
``record_stream``-ed on both streams before it is dropped. Index tensors made on the copy
stream and used by the compute stream are ``record_stream``-ed on it. On CPU-only machines
streams and events are ``None``, every copy is synchronous and the semantics are the same;
the prefetch thread still plans and gathers ahead into CPU staging.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import os
import queue
import threading
import time
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ._errors import StpipeIndexError, StpipeRuntimeError, StpipeTypeError, StpipeValueError
from .embedding import HostEmbedding, _Binding, _Part, _version
from ._cuda import compiled_calls, driver_calls
from ._staging import _UNFLATTEN, RING_BYTES, _Ring, _as_numpy, _pack_compiled, _template, _torch_dtype, _views
from ._staging import upload as _upload
from ._staging import upload_buffer as _upload_buffer
from ._streams import current_stream, on_stream
from .host import _finish
from .host import gather_many as _gather_many
from .host import scatter_many as _scatter_many
from .host import _prepare_move, _prepare_pair, _cupy_backend
from .kernels import IndexBatch
from .loader import _copy_to, _map_tensors
from .planner import Plan, as_index_array, check_ids, overlap
from .planner import plan as _plan

__all__ = ["Pipeline", "Step"]

_thread_ids = itertools.count()
#: tensor dtypes the pinned upload ring packs (numpy can hold them)
_NUMPY_DTYPES = frozenset((torch.float64, torch.float32, torch.float16, torch.int64, torch.int32,
                           torch.int16, torch.int8, torch.uint8, torch.bool))
_POLL = 0.05
#: cached paired launches (:meth:`Pipeline._paired`) kept before the cache is emptied
_PAIRS_MAX = 64
#: a prefetch delay shorter than this is slept through (``close()`` waits at most this)
_SLEEP_MAX = 0.02

#: id arrays at least this long are concatenated by :func:`stpipe._calls.pack` (GIL
#: released) rather than ``np.concatenate``
_PACK_MIN = 4096


def _concat_ids(arrs: Sequence[np.ndarray]) -> np.ndarray:
    """The flattened int64 concatenation of id arrays, copied with the GIL released when
    they are long, int64 and C-contiguous (``stpipe._calls``), else by numpy."""
    n = sum(a.size for a in arrs)
    calls = compiled_calls() if n >= _PACK_MIN else None
    if calls is not None and all(a.dtype == np.int64 and a.flags.c_contiguous for a in arrs):
        out = np.empty(n, dtype=np.int64)
        offs, o = [], 0
        for a in arrs:
            offs.append(o)
            o += a.nbytes
        if _pack_compiled(calls, out.__array_interface__["data"][0], arrs, offs):
            return out
    return np.concatenate([a.reshape(-1).astype(np.int64, copy=False) for a in arrs])


def _host_tensors(source: Any, device: torch.device) -> Tuple[List[torch.Tensor], int]:
    """The batch's CPU tensors of a dtype numpy holds (the ones the pinned upload packs),
    each once, in the order :func:`_map_tensors` meets them; and how many distinct tensors
    of the batch are not on ``device`` (equal to the list's length when the upload moves
    them all)."""
    moved: List[torch.Tensor] = []
    seen: Dict[int, Any] = {}

    def collect(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in seen:
            if t.is_cpu:
                seen[id(t)] = t
                if t.dtype in _NUMPY_DTYPES:
                    moved.append(t)
            elif t.device != device:
                seen[id(t)] = t
        return t

    _map_tensors(collect, source)
    return moved, len(seen)


def _set_aliases(tables: Iterable["_TableFlight"], alias: Mapping[int, torch.Tensor]) -> None:
    """Each table's ``aliases``: the device copy of each id part that was a batch tensor
    moved with the batch (``alias``: id of the source tensor -> its copy; so
    ``emb(step.batch[...])`` takes the planned path), else None."""
    for tf in tables:
        tf.aliases = [alias.get(id(x)) if torch.is_tensor(x) else None for x in tf.parts]


#: ``prefetch_delay="auto"``: the issue waits this fraction of the recent step period ...
_AUTO_FRACTION = 0.3
#: ... but no longer than leaves the issue this fraction of the period to spare
_AUTO_SLACK = 0.1
#: step periods and issue durations the ``"auto"`` delay takes the median of
_AUTO_HISTORY = 8


def _auto_delay(periods: Sequence[float], issues: Sequence[float], fraction: float = _AUTO_FRACTION) -> float:
    """Seconds the prefetch thread waits under ``prefetch_delay="auto"``.

    ``periods``: recent times between the training thread's slot frees (one per step);
    ``issues``: recent durations of the prefetch thread's issue (upload, gather launches,
    views). With ``P`` and ``I`` their medians: ``min(0.3 P, 0.9 P - I)``, so that a batch
    issued that late still ends its issue a tenth of a period before the step it overlaps
    does; 0 without a period yet, or when the issue takes most of a step. Measured on the
    H200 (benchmarks/RESULTS.md, 2026-12-04): 0.3 of the period was faster than no delay
    in 49 of 60 paired blocks of the 10M-row skip-gram benchmark.
    """
    if not periods:
        return 0.0
    p = _median(periods)
    i = _median(issues) if issues else 0.0
    return max(0.0, min(fraction * p, (1.0 - _AUTO_SLACK) * p - i))


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


# ---------------------------------------------------------------------------- helpers
def _is_parts(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(
        torch.is_tensor(p) or isinstance(p, np.ndarray) for p in x
    )


class _DevIds:
    """int64 ids uploaded with a batch: their device address and count for the fused
    kernels, and a tensor view made only when a fallback path asks (:meth:`tensor`),
    since each view costs torch calls in the prefetch thread."""

    __slots__ = ("ptr", "n", "_dev", "_host", "_off", "_t")

    def __init__(self, n: int, t: Optional[torch.Tensor] = None, dev: Optional[torch.Tensor] = None,
                 host: Optional[np.ndarray] = None, off: int = 0, base: Optional[int] = None) -> None:
        self.n = n
        self._t, self._dev, self._host, self._off = t, dev, host, off
        if t is not None:
            self.ptr = t.data_ptr()
        else:  # ``base``: ``dev.data_ptr()`` when the caller has it
            self.ptr = (dev.data_ptr() if base is None else base) + off

    def tensor(self) -> torch.Tensor:
        if self._t is None:
            self._t = _views(self._dev, [self._host], [self._off])[0]
        return self._t


@dataclass
class _TableFlight:
    """One table's part of a batch in flight."""

    plan: Plan
    parts: List[Any]  # the ids objects (one, or several planned together)
    single: bool
    part_inverse: List[torch.Tensor] = field(default_factory=list)  # device, each part's shape
    aliases: List[Any] = field(default_factory=list)  # each part's copy in the moved batch (or None)
    keys: Tuple[str, ...] = ()  # state keys gathered into the slot
    _rows: Optional[IndexBatch] = field(default=None, repr=False)
    #: ``plan.unique`` on the device (CUDA runs; uploaded with the batch)
    dev_rows: Optional[_DevIds] = field(default=None, repr=False)
    #: the slot's views installed at step entry: rows and ``{key: state}``, made with the
    #: gather (prefetch thread) for :attr:`keys`; remade at entry when keys were found
    #: after the gather, and by the write-back when found during the step
    views: Optional[Tuple[torch.Tensor, Dict[str, torch.Tensor]]] = field(default=None, repr=False)
    #: what the embedding's forward needs during the step (made with the views)
    binding: Optional[_Binding] = field(default=None, repr=False)
    #: a C++ reference to each of :attr:`part_inverse` until the step's exit (:func:`_make_hold`)
    holds: List[Any] = field(default_factory=list, repr=False)

    @property
    def k(self) -> int:
        return self.plan.num_unique

    @property
    def rows(self) -> IndexBatch:
        """``plan.unique`` as one IndexBatch shared by every gather and scatter of this
        table's part of the batch (rows and each state key), so the ids are sort-checked
        once and uploaded once to the copy stream, where all of those transfers run."""
        if self._rows is None:
            self._rows = IndexBatch(host=self.plan.unique, is_sorted=True)
        return self._rows


class _Flight:
    """A batch between its gather and the end of its step."""

    def __init__(self, index: int, batch: Any, ids: Any):
        self.index = index
        self.batch = batch
        self.ids = ids
        self.tables: Dict[Any, _TableFlight] = {}
        self.slot: int = -1
        self.ready = None  # torch.cuda.Event on the copy stream
        self.overlaps: Dict[int, Dict[Any, Tuple[_DevIds, _DevIds]]] = {}
        self.plan_s = 0.0
        # the batch as the iterable gave it (kept alive until the step ends) and, when it
        # was moved to the device, the copies made and the event after them (copy stream)
        self.source = batch
        self.copies: List[torch.Tensor] = []
        self.dev_bufs: List[torch.Tensor] = []  # device buffers of uploaded ids (copy stream)
        self.batch_event = None
        self.claimed: List[Any] = []  # streams that already waited on batch_event
        #: the pipeline ring's region of this batch's upload, its guard event to come
        #: (:meth:`Pipeline._upload_lean`: ``ready`` is recorded behind the copy anyway)
        self.ring_entry: Optional[List[Any]] = None


@dataclass
class _Failure:
    exc: BaseException
    where: str
    thread: str


_END = object()


class _Gate:
    """When the prefetch thread may issue a batch: after the training thread began step
    ``i`` (first lookup) or left it (:meth:`open`). Cheap for the training thread once
    open: one comparison."""

    __slots__ = ("cond", "step")

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.step = -1  # the latest step begun or left

    def open(self, index: int) -> None:
        if self.step < index:
            with self.cond:
                if self.step < index:
                    self.step = index
                    self.cond.notify_all()

    def wait(self, index: int, stop: threading.Event) -> bool:
        """Until step ``index`` has begun (True) or ``stop`` is set (False)."""
        if self.step >= index:
            return True
        with self.cond:
            while self.step < index:
                if stop.is_set():
                    return False
                self.cond.wait(_POLL)
        return True


def _gate_enabled() -> bool:
    """``STPIPE_PREFETCH_GATE=1`` (read at each run's start): the experimental prefetch
    gate is on. Off by default: it slowed the 10M-row benchmark in two runs of two."""
    return os.environ.get("STPIPE_PREFETCH_GATE", "0").strip().lower() in ("1", "true", "yes", "on")


class _Run:
    """The state of one ``Pipeline.run`` (thread, queues, stop flag)."""

    def __init__(self, num_slots: int, depth: int):
        self.stop = threading.Event()
        # SimpleQueue: put and get are C calls, no Python Condition on either thread. Both
        # are bounded by the slots: the prefetch thread hands over at most one flight per
        # slot it holds, then one _END or _Failure
        self.free_slots: "queue.SimpleQueue[int]" = queue.SimpleQueue()
        for s in range(num_slots):
            self.free_slots.put(s)
        self.out: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self.thread: Optional[threading.Thread] = None
        self.where = "starting"
        self.closed = False
        self.gate: Optional[_Gate] = _Gate() if depth >= 1 and _gate_enabled() else None
        #: ``time.perf_counter()`` when the training thread last freed each slot
        self.freed: Dict[int, float] = {}
        self._last_free: Optional[float] = None
        #: recent times between slot frees and recent issue durations (``"auto"`` delay)
        self.periods: Deque[float] = deque(maxlen=_AUTO_HISTORY)
        self.issues: Deque[float] = deque(maxlen=_AUTO_HISTORY)

    def free(self, slot: int) -> None:
        """Give a slot back (training thread), noting when."""
        now = time.perf_counter()
        if self._last_free is not None:
            self.periods.append(now - self._last_free)
        self._last_free = now
        self.freed[slot] = now
        self.free_slots.put(slot)

    def take_slot(self) -> Optional[int]:
        while not self.stop.is_set():
            try:
                return self.free_slots.get(timeout=_POLL)
            except queue.Empty:
                continue
        return None

    def put(self, item: Any) -> bool:
        """Hand ``item`` to the training thread; False (not handed) once stopped."""
        if self.stop.is_set():
            return False
        self.out.put(item)
        return True


class _Slots:
    """Staging buffers of one table: rows and per-row state, one set per slot.

    Layout per slot: one *stack* ``(1 + m, cap, dim)`` of the rows' dtype, plane 0 the
    rows and planes ``1..m`` the state keys of that dtype (``stacked``, in discovery
    order), so one fused kernel gathers or scatters them all and a fix-up is one carry
    launch (or ``index_select`` + ``index_copy_`` along dim 1). A state key of another dtype (none in
    ``torch.optim`` today) gets its own ``(cap, dim)`` buffer in ``extra``.
    """

    def __init__(self, emb: HostEmbedding, num_slots: int):
        self.emb = emb
        self.stack: List[Optional[torch.Tensor]] = [None] * num_slots
        self.stacked: List[Tuple[str, ...]] = [()] * num_slots
        self.extra: List[Dict[str, torch.Tensor]] = [dict() for _ in range(num_slots)]
        self.cap = [0] * num_slots
        #: per slot: (op, first plane, planes) -> (tables, prepared move or None), for
        #: the slot's current stack (cleared when :meth:`ensure` replaces it)
        self.moves: List[Dict[Tuple[str, int, int], Tuple[List[Any], Any]]] = [dict() for _ in range(num_slots)]
        #: (source slot, destination slot, planes) -> (source stack, destination stack,
        #: prepared carry or None), checked against the current stacks (:meth:`carry`)
        self.carries: Dict[Tuple[int, int, int], Tuple[torch.Tensor, torch.Tensor, Any]] = {}

    def rows(self, slot: int, k: int) -> torch.Tensor:
        return self.stack[slot][0, :k]

    def state(self, slot: int, key: str, k: int) -> torch.Tensor:
        keys = self.stacked[slot]
        if key in keys:
            return self.stack[slot][1 + keys.index(key), :k]
        return self.extra[slot][key][:k]

    def views(self, slot: int, k: int, keys: Iterable[str]) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """The slot's first ``k`` rows and ``{key: state rows}``: what a step installs
        (every plane of the stack by two torch calls)."""
        planes = self.stack[slot].narrow(1, 0, k).unbind(0)
        stacked = self.stacked[slot]
        return planes[0], {key: (planes[1 + stacked.index(key)] if key in stacked else self.extra[slot][key][:k])
                           for key in keys}

    def stacked_among(self, slot: int, keys: Iterable[str]) -> List[str]:
        """The stacked keys among ``keys``, in stack order (a prefix of the stack)."""
        return [key for key in self.stacked[slot] if key in keys]

    def move(self, slot: int, op: str, lo: int, tables: List[Any]) -> Any:
        """The prepared fused ``op`` of ``tables`` over planes ``lo..lo+len(tables)-1`` of
        the slot's stack (:func:`stpipe.host._prepare_move`), or ``None`` where no fused
        kernel moves them. Made once per stack and table set, so a batch's gather or
        write-back of one table is one call with the ids' pointer and count."""
        cache = self.moves[slot]
        key = (op, lo, len(tables))
        hit = cache.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], tables)):
            return hit[1]
        move = _prepare_move(op, tables, self.stack[slot][lo:lo + len(tables)])
        cache[key] = (list(tables), move)
        return move

    def carry(self, src: int, dst: int, planes: int) -> Any:
        """The prepared carry of the first ``planes`` planes from slot ``src``'s stack into
        slot ``dst``'s (``CupyBackend.prepare_carry``: a fix-up is then one call with the
        two index addresses), or ``None`` where the carry kernel cannot run. Made once per
        pair of stacks."""
        key = (src, dst, planes)
        a, b = self.stack[src], self.stack[dst]
        hit = self.carries.get(key)
        if hit is not None and hit[0] is a and hit[1] is b:
            return hit[2]
        carrier = _cupy_backend()
        prepared = None
        if carrier is not None and a.shape[2] * a.element_size() % 2 == 0:
            prepared = carrier.prepare_carry(a, b, planes)
        self.carries[key] = (a, b, prepared)
        return prepared

    def fits(self, slot: int, k: int, keys: Sequence[str]) -> bool:
        """Whether slot ``slot`` holds ``k`` rows and every key already (no :meth:`ensure`)."""
        if self.stack[slot] is None or k > self.cap[slot]:
            return False
        stacked, extra = self.stacked[slot], self.extra[slot]
        return all(key in stacked or key in extra for key in keys)

    def ensure(self, slot: int, k: int, keys: Sequence[str], streams: Sequence[Any]) -> None:
        """Make slot ``slot`` hold at least ``k`` rows and a buffer for each state key.

        A stack that must grow or gain keys is replaced; what the old one held is copied
        over on the current stream (the caller's: the copy stream before a gather, the
        compute stream in a write-back). Replaced buffers are ``record_stream``-ed on
        ``streams`` (CUDA) before release so the caching allocator does not hand their
        memory out while queued work uses it.
        """
        emb = self.emb
        rs = emb.row_state
        cap = self.cap[slot]
        same = tuple(key for key in keys if rs.tables[key].dtype == emb.dtype) if keys else ()
        old_keys = self.stacked[slot]
        want = old_keys + tuple(key for key in same if key not in old_keys)
        old = self.stack[slot]
        if old is None or k > cap or want != old_keys:
            new_cap = max(k, emb.capacity, (cap * 3) // 2 if k > cap else cap, 1)
            new = torch.empty(1 + len(want), new_cap, emb.embedding_dim, dtype=emb.dtype, device=emb.device)
            n = min(cap, new_cap)  # rows worth keeping
            if old is not None:
                new[: old.shape[0], :n].copy_(old[:, :n])
                self._retire(old, streams)
            self.stack[slot], self.stacked[slot] = new, want
            self.moves[slot].clear()
            for key in [key for key in self.carries if slot in key[:2]]:
                del self.carries[key]
            extra = self.extra[slot]
            for key, buf in list(extra.items()):
                grown = torch.empty(new_cap, emb.embedding_dim, dtype=buf.dtype, device=emb.device)
                grown[:n].copy_(buf[:n])
                self._retire(buf, streams)
                extra[key] = grown
            self.cap[slot] = cap = new_cap
        for key in keys:
            if key not in self.stacked[slot] and key not in self.extra[slot]:
                dtype = rs.tables[key].dtype
                self.extra[slot][key] = torch.empty(cap, emb.embedding_dim, dtype=dtype, device=emb.device)

    @staticmethod
    def _retire(buf: Optional[torch.Tensor], streams: Sequence[Any]) -> None:
        if buf is None or buf.device.type != "cuda":
            return
        for s in streams:
            if s is not None:
                buf.record_stream(s)


# ------------------------------------------------------------------------------ Step
class Step:
    """One training step: a context manager around the user's forward/backward/optimizer.

    Attributes:
        index: the batch's position in the iterable (0-based).
        batch: the batch; with CUDA and ``run(to_device=True)`` its CPU tensors moved to
            the device (see the :attr:`batch` property), else as the iterable gave it.
        ids: for one table the ids object ``ids=`` gave; for several a new dict
            ``name -> ids`` of the tables' names only (other keys a callable ``ids=``
            returns are ignored). Pass them (or their parts) to the embedding.
        plans: ``{name: Plan}`` (``None`` is the name of a single table).

    ``with step:`` waits (stream-wise) only for this step's rows; leaving normally writes
    the rows and optimizer state back; leaving by exception writes nothing back and
    restores the optimizer's scalar state. A step that is never entered is skipped (nothing
    written back). A step cannot be entered twice.
    """

    def __init__(self, pipeline: "Pipeline", flight: _Flight) -> None:
        self._pipe = pipeline
        self._flight = flight
        self._entered = False
        self._exited = False
        self._snaps: Dict[Any, Any] = {}
        self._opt_steps = 0  # the pipeline's count of optimizer steps at entry
        self._t_enter = 0.0
        self._compute_stream = None
        self._issued = False  # the write-back got past its checks (:meth:`Pipeline._write_back`)
        self.record: Dict[str, float] = {}

    @property
    def index(self) -> int:
        """The batch's position in the iterable (0-based)."""
        return self._flight.index

    @property
    def batch(self) -> Any:
        """The batch, its tensors on the pipeline's device (moved ahead on the copy stream).

        The caller's current stream waits for the copies (no host sync) the first time it
        reads the batch; see :meth:`Pipeline.run`.
        """
        self._pipe._claim_batch(self._flight)
        return self._flight.batch

    @property
    def ids(self) -> Any:
        """The ids ``ids=`` gave (for several tables, a new dict ``name -> ids`` of the
        tables' names only); pass them, or their parts, to the embedding:
        ``emb(step.ids)`` takes the rows this step gathered without looking them up
        again."""
        return self._flight.ids

    @property
    def plans(self) -> Dict[Any, Plan]:
        """``{name: Plan}``: each table's deduplicated ids (``None`` names a single table)."""
        return {name: tf.plan for name, tf in self._flight.tables.items()}

    def __repr__(self) -> str:
        state = "done" if self._exited else ("active" if self._entered else "ready")
        return f"Step(index={self.index}, {state}, unique={ {n: tf.k for n, tf in self._flight.tables.items()} })"

    def __enter__(self) -> "Step":
        if self._entered:
            raise StpipeRuntimeError(f"step {self.index} was already entered; a step runs once")
        self._pipe._enter(self)
        self._entered = True
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Any) -> bool:
        self._exited = True
        self._pipe._exit(self, failed=exc_type is not None)
        return False


# -------------------------------------------------------------------------- Pipeline
TablesArg = Union[HostEmbedding, Mapping[Any, HostEmbedding], Sequence[HostEmbedding]]


class Pipeline:
    """Train :class:`~stpipe.HostEmbedding` tables with prefetch and write-back.

    Args:
        tables: one ``HostEmbedding``, a dict ``name -> HostEmbedding``, or a list (names
            ``0..n-1``).
        optimizer: the ``torch.optim`` optimizer (or a list of them) that trains the
            tables' weights; their per-row state is offloaded with the rows. ``None``: no
            optimizer state is moved (a stateless optimizer, e.g. plain SGD); an optimizer
            not given here that keeps per-row state for a table's weight (Adam, SGD with
            momentum) raises :class:`~stpipe.StpipeRuntimeError` from its ``step()``, as
            its state would stay with positions, not rows.
        ids: where the row ids of a batch are. One table: ``None`` (the batch is the ids),
            a key (``batch[key]``) or a callable ``batch -> ids``. Several tables: a
            callable ``batch -> {name: ids}``, or a dict ``name -> key or callable``
            (``None``: ``batch[name]``). A table's ids may be a tuple/list of id tensors.
        depth: batches gathered ahead of the one being trained (default 1; 0 runs the
            strict sequence in the training thread).
        profile: record per-step timings in :attr:`profile` (plan / gather wait / compute
            / write-back, ms); on CUDA this synchronises at each phase, so steps overlap
            less while profiling.
        join_timeout: seconds :meth:`close` waits for the prefetch thread.
        prefetch_delay: how long the prefetch thread waits after the training thread
            frees a staging slot (at the start of a step) before issuing the next batch
            into it (depth >= 1; timing only, never results), so that the issue's
            GIL-bound Python falls into the step's ``backward()``, where the training
            thread waits without the GIL, rather than into its entry and forward pass.
            ``"auto"`` (default): on CUDA 0.3 of the recent step period, capped so the
            issue still ends a tenth of a period before the step does
            (:func:`stpipe.pipeline._auto_delay`); on CPU no wait. A number: that many
            seconds. ``0``: issue as soon as a slot frees. Slots not yet used in a run
            are never waited for. benchmarks/RESULTS.md (2026-12-04) has the paired
            measurements behind the default; :attr:`stats` ``["delayed_s"]`` sums the waits.

    Raises:
        StpipeTypeError: a table is not a ``HostEmbedding`` or the arguments have the
            wrong type.
        StpipeValueError: negative ``depth``, tables on different devices, a table whose
            weight is in none of the given optimizers, one table given twice, a negative
            or non-finite ``prefetch_delay``, or a string other than ``"auto"``.
    """

    #: hold each lookup's index tensor for the step (:func:`_make_hold`); a class
    #: attribute so that an A/B can turn it off on one instance
    _hold_indices = True
    #: hold the lookups' differentiable outputs for the step too (a view of each: the
    #: ``einsum``/``bmm`` of a loss saves views of them, whose release decrefs them)
    _hold_outputs = True
    #: the ``"auto"`` delay's fraction of the step period (:func:`_auto_delay`); an
    #: instance may set its own (an A/B)
    _auto_fraction = _AUTO_FRACTION
    #: the lookups' index tensors (each table's inverse) go to the device as int32 rather
    #: than int64 (:func:`_inverse_host`); a class attribute so that an A/B can turn it
    #: off on one instance
    _inv32 = True

    def __init__(
        self,
        tables: TablesArg,
        optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None] = None,
        *,
        ids: Any = None,
        depth: int = 1,
        profile: bool = False,
        join_timeout: float = 5.0,
        prefetch_delay: Union[float, str] = "auto",
    ) -> None:
        if isinstance(tables, HostEmbedding):
            self._single = True
            self.tables: Dict[Any, HostEmbedding] = {None: tables}
        elif isinstance(tables, Mapping):
            self._single = False
            self.tables = dict(tables)
        elif isinstance(tables, (list, tuple)):
            self._single = False
            self.tables = dict(enumerate(tables))
        else:
            raise StpipeTypeError(
                f"tables must be a HostEmbedding, a dict or a list of them, got {type(tables).__name__}"
            )
        if not self.tables:
            raise StpipeValueError("Pipeline needs at least one table")
        seen = set()
        hosts: Dict[int, Any] = {}
        for name, emb in self.tables.items():
            if not isinstance(emb, HostEmbedding):
                raise StpipeTypeError(f"table {name!r} must be a HostEmbedding, got {type(emb).__name__}")
            if id(emb) in seen:
                raise StpipeValueError(f"table {name!r} is given twice")
            seen.add(id(emb))
            other = hosts.setdefault(id(emb.table), name)
            if other != name:  # each would carry and write back the shared rows on its own
                raise StpipeValueError(
                    f"tables {other!r} and {name!r} wrap the same HostTable; expected one "
                    "HostEmbedding per HostTable. For tied weights, use one table and give "
                    "it the id fields as a tuple: ids=lambda b: {..., 'tied': (b['a'], b['b'])}"
                )
        devices = {emb.device for emb in self.tables.values()}
        if len(devices) != 1:
            raise StpipeValueError(f"all tables must share one device, got {sorted(map(str, devices))}")
        self.device: torch.device = devices.pop()
        if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or depth < 0:
            raise StpipeValueError(f"depth must be an int >= 0, got {depth!r}")
        self.depth = int(depth)
        self._num_slots = self.depth + 1
        if optimizer is None:
            self._optimizers: List[torch.optim.Optimizer] = []
        elif isinstance(optimizer, torch.optim.Optimizer):
            self._optimizers = [optimizer]
        elif isinstance(optimizer, (list, tuple)) and all(isinstance(o, torch.optim.Optimizer) for o in optimizer):
            self._optimizers = list(optimizer)
        else:
            raise StpipeTypeError(
                f"optimizer must be a torch.optim.Optimizer, a list of them or None, got {type(optimizer).__name__}"
            )
        if not self._optimizers:
            _watch_unbound(self.tables.items())
        self._ids_fn = self._make_ids_fn(ids)
        if isinstance(prefetch_delay, str):
            if prefetch_delay != "auto":
                raise StpipeValueError(f"prefetch_delay must be seconds >= 0 or 'auto', got {prefetch_delay!r}")
        elif isinstance(prefetch_delay, bool) or not isinstance(prefetch_delay, (int, float, np.integer, np.floating)):
            raise StpipeTypeError(
                f"prefetch_delay must be a number of seconds or 'auto', got {type(prefetch_delay).__name__}"
            )
        elif not (math.isfinite(prefetch_delay) and prefetch_delay >= 0):
            raise StpipeValueError(f"prefetch_delay must be seconds >= 0 or 'auto', got {prefetch_delay!r}")
        #: the wait after a slot frees before the prefetch thread issues into it (depth >= 1):
        #: ``"auto"`` or seconds
        self.prefetch_delay: Union[float, str] = "auto" if isinstance(prefetch_delay, str) else float(prefetch_delay)
        self._profile = bool(profile)
        self.profile: List[Dict[str, float]] = []
        self.stats = {"steps": 0, "failed": 0, "skipped": 0, "rows_gathered": 0, "rows_carried": 0,
                      "delayed_s": 0.0}
        #: CPU seconds the prefetch threads of this pipeline have used (``time.thread_time``)
        self.prefetch_cpu_s = 0.0
        if isinstance(join_timeout, bool) or not isinstance(join_timeout, (int, float, np.integer, np.floating)):
            raise StpipeTypeError(
                f"join_timeout must be a number of seconds, got {type(join_timeout).__name__}: {join_timeout!r}"
            )
        if not join_timeout >= 0:
            raise StpipeValueError(f"join_timeout must be seconds >= 0, got {join_timeout!r}")
        self.join_timeout = float(join_timeout)
        self._cuda = self.device.type == "cuda"
        #: whether ``prefetch_delay="auto"`` waits (CUDA: the GIL's cost was measured there)
        self._auto_waits = self._cuda
        self._copy_stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        self._lock = threading.Lock()
        self._inflight: Dict[int, _Flight] = {}
        self._slots = {name: _Slots(emb, self._num_slots) for name, emb in self.tables.items()}
        self._run: Optional[_Run] = None
        self._closed = False
        self._compute_stream = None
        self._to_device = True
        #: the issuing thread's own pinned upload ring (CUDA; made at the first upload)
        self._issue_ring: Optional[_Ring] = None
        #: whether uploads take :meth:`_upload_lean` where it applies (off: the general path)
        self._lean = True
        #: re-recorded by every write-back: the copy stream's wait for the step's compute
        self._done_ev = None
        #: re-recorded by every write-back behind its scatters: the tables' write event
        self._wb_ev = None
        #: whether two tables' fused gathers, scatters and carries share one launch where
        #: their kernels pair (off: one launch per table)
        self._pair = True
        #: (id(a), id(b)) -> (a, b, paired launch or None) (:meth:`_paired`; issue lock)
        self._pairs: Dict[Tuple[int, int], Tuple[Any, Any, Any]] = {}
        #: optimizer steps counted by hooks on the given optimizers, to tell a step that
        #: left a gradient unapplied (warned once)
        self._opt_steps = 0
        self._step_hooks: List[Any] = []
        self._warned_unapplied = False
        self._bind_optimizers()

    # ------------------------------------------------------------------ set-up
    def _bind_optimizers(self) -> None:
        if not self._optimizers:
            return
        for name, emb in self.tables.items():
            owners = [i for i, opt in enumerate(self._optimizers)
                      if any(p is emb.weight for g in opt.param_groups for p in g["params"])]
            if not owners:
                raise StpipeValueError(
                    f"the weight of table {name!r} is in none of the given optimizers; pass "
                    "every optimizer that trains a table (its per-row state must travel with the rows)"
                )
            if len(owners) > 1:
                raise StpipeValueError(
                    f"the weight of table {name!r} is in optimizers {owners} of the given "
                    "list; expected one optimizer per table (stpipe moves one optimizer's "
                    "per-row state with the rows)"
                )
            emb.bind_optimizer(self._optimizers[owners[0]])
        me = weakref.ref(self)

        def count(opt: Any, args: Any, kwargs: Any) -> None:
            pipe = me()
            if pipe is not None:
                pipe._opt_steps += 1

        self._step_hooks = [opt.register_step_post_hook(count) for opt in self._optimizers]

    def _make_ids_fn(self, ids: Any) -> Callable[[Any], Dict[Any, Any]]:
        names = list(self.tables)
        if self._single:
            if ids is None:
                return lambda b: {None: b}
            if callable(ids):
                return lambda b: {None: ids(b)}
            if isinstance(ids, (Mapping, list, set)):
                raise StpipeTypeError(
                    f"ids= for one table must be None, a key of the batch or a callable "
                    f"batch -> ids, got a {type(ids).__name__} (a dict maps several tables' "
                    "names to keys)"
                )
            return lambda b: {None: b[ids]}
        if ids is None:
            return lambda b: {n: b[n] for n in names}
        if callable(ids):
            def fn(b):
                out = ids(b)
                if not isinstance(out, Mapping):
                    raise StpipeTypeError(
                        f"ids= must return a dict name -> ids for several tables, got {type(out).__name__}"
                    )
                missing = [n for n in names if n not in out]
                if missing:
                    raise StpipeValueError(f"ids= returned no ids for table(s) {missing}; got keys {list(out)}")
                return {n: out[n] for n in names}
            return fn
        if isinstance(ids, Mapping):
            unknown = [k for k in ids if k not in self.tables]
            if unknown:
                raise StpipeValueError(f"ids= names unknown table(s) {unknown}; tables are {names}")
            getters = {}
            for n in names:
                g = ids.get(n)
                g = n if g is None else g  # left out or None: batch[name]
                getters[n] = g if callable(g) else (lambda b, _k=g: b[_k])
            return lambda b: {n: getters[n](b) for n in names}
        raise StpipeTypeError(
            f"ids= for several tables must be None (batch[name]), a callable batch -> "
            f"{{name: ids}} or a dict name -> key or callable, got {type(ids).__name__}"
        )

    # -------------------------------------------------------------- public API
    def run(self, iterable: Iterable[Any], *, to_device: bool = True) -> Iterator[Step]:
        """Yield one :class:`Step` per batch of ``iterable``; batches are read ahead.

        The ids of each batch (``ids=``) go to the planner; the batch itself (every tensor
        in any nesting of dicts, lists, tuples, namedtuples, dataclasses) is copied to the
        pipeline's device ahead of its step, so ``step.batch`` holds device tensors.

        Streams (CUDA): the copies run on the pipeline's copy stream, issued by the
        prefetch thread (by the training thread at depth 0) before the batch's gather: the
        batch's CPU tensors and the planned ids travel together, packed into stpipe's pinned
        upload ring and moved by one asynchronous copy (a tensor of a dtype numpy lacks,
        bfloat16, is pinned and copied on its own). No host sync: entering the step (or
        reading ``step.batch``) makes the current stream wait on the batch's event, and the
        device buffer is ``record_stream``-ed on it. The source batch is kept alive until the step
        ends. Tensors already on the device pass through. On CPU nothing moves.

        Args:
            iterable: any iterable of batches (a ``DataLoader``, its iterator, a list, a
                generator).
            to_device: move the batch to the device (default); ``False`` hands
                ``step.batch`` out as the iterable gave it.

        Returns:
            An iterator of steps; use each as ``with step: ...``.

        Raises:
            StpipeRuntimeError: the pipeline is closed, or another run is active.
            StpipeTypeError: ``iterable`` is not iterable (a ``TypeError``).
        """
        self._check_open()
        try:
            it = iter(iterable)
        except TypeError as exc:
            raise StpipeTypeError(
                f"Pipeline.run expects an iterable of batches (a DataLoader, its iterator, a "
                f"list, a generator); got {type(iterable).__name__}"
            ) from exc
        self._check_no_run()  # said now, not at the first next() of the generator
        return self._steps(it, bool(to_device))

    def close(self) -> None:
        """Stop the prefetch thread (joined with ``join_timeout``), wait for write-backs.

        Idempotent; never hangs on the iterable (a thread blocked in it is left behind as a
        daemon, with a warning). Batches read ahead and not trained are dropped.
        """
        if self._closed:
            return
        self._closed = True
        for hook in self._step_hooks:
            hook.remove()
        if self._run is not None:
            self._shutdown(self._run)
        self.synchronize()

    def synchronize(self) -> None:
        """Wait until every write-back issued so far reached the host tables."""
        if self._cuda:
            self._copy_stream.synchronize()
        for emb in self.tables.values():
            for t in [emb.table, *emb.state_tables.values()]:
                sync = getattr(t, "synchronize", None)
                if callable(sync):
                    sync()

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Tables, per-row optimizer state, optimizer hyper-parameters and scalar state.

        Between steps, also with batches in flight: it first waits for every write-back
        issued so far, so the host tables hold every finished step and nothing stale. The
        tables are views (no copy); see :func:`stpipe.checkpoint.state_dict`.

        Raises:
            StpipeRuntimeError: called inside a step.
        """
        from . import checkpoint

        return checkpoint.state_dict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load :meth:`state_dict` output, checked first (see :func:`stpipe.checkpoint.load_state_dict`).

        Raises:
            StpipeValueError: other table names/shapes/dtypes or optimizer classes.
            StpipeRuntimeError: a run is active (finish or close it first).
        """
        from . import checkpoint

        checkpoint.load_state_dict(self, state)

    def save_checkpoint(self, path: Any, extra: Any = None) -> str:
        """Write an atomic checkpoint directory at ``path`` (see :func:`stpipe.checkpoint.save`).

        Returns:
            The absolute path written.
        """
        from . import checkpoint

        return checkpoint.save(path, self, extra=extra)

    def load_checkpoint(self, path: Any, *, verify: str = "first") -> Any:
        """Load the checkpoint at ``path`` before a run (see :func:`stpipe.checkpoint.load`).

        Returns:
            The ``extra`` given when saving.
        """
        from . import checkpoint

        return checkpoint.load(path, self, verify=verify)

    def _after_load(self, stats: Any) -> None:
        """Forget staging buffers (state dtypes may have changed); restore the counters."""
        self._slots = {name: _Slots(emb, self._num_slots) for name, emb in self.tables.items()}
        if isinstance(stats, Mapping):
            for k, v in stats.items():
                if k in self.stats and isinstance(v, int):
                    self.stats[k] = v

    def __enter__(self) -> "Pipeline":
        self._check_open()
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.close()
        return False

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            if self._run is not None:
                self._run.stop.set()
        except Exception:
            pass

    def __repr__(self) -> str:
        names = list(self.tables) if not self._single else ["<single>"]
        return f"Pipeline(tables={names}, depth={self.depth}, device={self.device}, closed={self._closed})"

    def _check_open(self) -> None:
        if self._closed:
            raise StpipeRuntimeError("the pipeline is closed; make a new Pipeline")

    # ------------------------------------------------------------------ the run
    def _check_no_run(self) -> None:
        if self._run is not None:
            raise StpipeRuntimeError(
                "another run of this pipeline is active; finish it (or close the pipeline) first"
            )

    def _steps(self, it: Iterator[Any], to_device: bool) -> Iterator[Step]:
        self._check_open()
        self._check_no_run()  # another generator may have started since run() made this one
        run = _Run(self._num_slots, self.depth)
        self._run = run
        self._to_device = to_device  # this run's (read by the uploads of its batches)
        self._inflight.clear()
        try:
            if self.depth == 0:
                for idx, batch in enumerate(it):
                    flight = self._prepare(idx, batch, run)
                    flight.slot = run.free_slots.get_nowait()
                    self._upload(flight, [])
                    with self._lock:
                        self._gather(flight)
                        self._inflight[idx] = flight
                    yield from self._deliver(flight, run)
                    if run.closed:
                        return
                return
            name = f"stpipe-prefetch-{next(_thread_ids)}"
            run.thread = threading.Thread(target=self._producer, args=(run, it), name=name, daemon=True)
            run.thread.start()
            while True:
                item = self._next_item(run)
                if item is _END or item is None:
                    return
                if isinstance(item, _Failure):
                    self._reraise(item)
                yield from self._deliver(item, run)
                if run.closed:
                    return
        finally:
            self._shutdown(run)

    def _deliver(self, flight: _Flight, run: _Run) -> Iterator[Step]:
        step = Step(self, flight)
        try:
            yield step
        finally:
            if not step._entered:
                self._drop(flight, run)
                self.stats["skipped"] += 1
        if step._entered and not step._exited:
            raise StpipeRuntimeError(
                f"step {flight.index} was entered but not exited before the next one; use `with step:`"
            )

    def _next_item(self, run: _Run) -> Any:
        while True:
            if run.closed:
                return None
            try:
                return run.out.get(timeout=_POLL)
            except queue.Empty:
                pass
            if run.thread is not None and not run.thread.is_alive():
                try:
                    return run.out.get_nowait()
                except queue.Empty:
                    raise StpipeRuntimeError(
                        f"the prefetch thread {run.thread.name!r} ended without a result (last: {run.where})"
                    ) from None

    @staticmethod
    def _reraise(fail: _Failure) -> None:
        exc = fail.exc
        note = f"stpipe: raised in the prefetch thread {fail.thread!r} while {fail.where}"
        if hasattr(exc, "add_note"):
            exc.add_note(note)
            raise exc
        raise StpipeRuntimeError(f"{note}: {type(exc).__name__}: {exc}") from exc  # pragma: no cover

    def _shutdown(self, run: _Run) -> None:
        if run.closed:
            return
        run.closed = True
        run.stop.set()
        th = run.thread
        if th is not None and th.is_alive() and th is not threading.current_thread():
            th.join(self.join_timeout)
            if th.is_alive():
                warnings.warn(
                    f"stpipe: the prefetch thread {th.name!r} did not stop within "
                    f"{self.join_timeout} s (it is {run.where}); it is a daemon thread and is "
                    "left behind; it will issue no more copies",
                    RuntimeWarning,
                    stacklevel=3,
                )
        while True:
            try:
                run.out.get_nowait()
            except queue.Empty:
                break
        with self._lock:
            self._inflight.clear()
        if self._run is run:
            self._run = None
        if self._cuda:
            self._copy_stream.synchronize()

    # --------------------------------------------------------- prefetch thread
    def _producer(self, run: _Run, it: Iterator[Any]) -> None:
        slot = None
        cpu0 = time.thread_time()
        try:
            if self._cuda:
                torch.cuda.set_device(self.device)
            for idx in itertools.count():
                if run.stop.is_set():
                    return
                run.where = f"reading batch {idx} from the iterable"
                try:
                    batch = next(it)
                except StopIteration:
                    run.put(_END)
                    return
                if run.stop.is_set():
                    return
                flight = self._prepare(idx, batch, run)
                run.where = f"waiting for a free staging slot for batch {idx}"
                slot = run.take_slot()
                if slot is None:
                    return
                flight.slot = slot
                if run.gate is not None:
                    run.where = f"waiting for step {idx - self.depth} to begin before issuing batch {idx}"
                    if not run.gate.wait(idx - self.depth, run.stop):
                        return
                if not self._wait_delay(run, idx, slot):
                    return
                t_issue = time.perf_counter()
                self._issue(flight, run)
                run.issues.append(time.perf_counter() - t_issue)
                slot = None  # owned by the flight now
                run.where = f"handing batch {idx} to the training thread"
                cpu1 = time.thread_time()
                self.prefetch_cpu_s += cpu1 - cpu0
                cpu0 = cpu1
                if not run.put(flight):
                    return
        except BaseException as exc:  # noqa: BLE001 - everything goes to the training thread
            if slot is not None:
                run.free_slots.put(slot)
            run.put(_Failure(exc, run.where, threading.current_thread().name))

    def _wait_delay(self, run: _Run, idx: int, slot: int) -> bool:
        """Wait until ``prefetch_delay`` after the training thread freed ``slot`` (the
        start of the step this batch's issue will overlap); no wait for a slot never
        used in this run, or freed longer ago than the delay. False if stopped."""
        t0 = run.freed.get(slot)
        if t0 is None:
            return True
        d = self.prefetch_delay
        if isinstance(d, str):  # "auto"
            if not self._auto_waits:
                return True
            d = _auto_delay(list(run.periods), list(run.issues), self._auto_fraction)
        if d <= 0.0:
            return True
        wait = t0 + d - time.perf_counter()
        if wait <= 0.0:
            return True
        run.where = f"waiting {wait * 1e3:.2f} ms (prefetch_delay) before issuing batch {idx}"
        self.stats["delayed_s"] += wait
        if wait < _SLEEP_MAX:  # one sleep: less of the GIL than Event.wait's Condition
            time.sleep(wait)
            return not run.stop.is_set()
        return not run.stop.wait(wait)

    def _prepare(self, idx: int, batch: Any, run: _Run) -> _Flight:
        """Ids and plans of one batch (no copies)."""
        run.where = f"computing the ids of batch {idx} (the ids= function)"
        ids = self._ids_fn(batch)
        flight = _Flight(idx, batch, ids[None] if self._single else ids)
        t0 = time.perf_counter()
        for name, emb in self.tables.items():
            run.where = f"planning batch {idx}" + ("" if self._single else f" for table {name!r}")
            x = ids[name]
            if _is_parts(x):
                arrs = [as_index_array(p) for p in x]
                flat = _concat_ids(arrs)
                try:
                    p = _plan(flat, emb.num_rows)  # checks the range in the compiled pass
                except StpipeIndexError:
                    for part in x:  # name the part and position of the first bad id
                        check_ids(part, emb.num_rows)
                    raise
                flight.tables[name] = _TableFlight(plan=p, parts=list(x), single=False)
                flight.tables[name]._shapes = [a.shape for a in arrs]  # type: ignore[attr-defined]
            else:
                p = _plan(x, emb.num_rows)
                flight.tables[name] = _TableFlight(plan=p, parts=[x], single=True)
        flight.plan_s = time.perf_counter() - t0
        return flight

    def _upload(self, flight: _Flight, pending: Sequence[Tuple[int, Any, np.ndarray, np.ndarray]]) -> None:
        """Move a batch's index arrays (each table's inverse and unique rows, the
        overlaps ``pending`` with batches in flight) and, when ``run(to_device=True)``,
        the batch's CPU tensors to the device in *one* copy.

        Stream: the copy stream, through the pinned upload ring (:mod:`stpipe._staging`:
        no pageable copy, no stream sync); ``flight.batch_event`` is the event recorded
        behind it when the batch moved. Everything lands in one device buffer allocated
        on the copy stream; consumers make their stream wait and ``record_stream`` it
        (:meth:`_claim_batch`, :meth:`_enter`). A tensor seen twice is copied once
        (aliasing kept); the planned id tensors' copies are remembered so
        ``emb(step.batch[...])`` takes the fast path. Tensors of a dtype numpy cannot
        hold (bfloat16) are pinned and copied on their own. On CPU nothing moves.
        """
        if self._cuda and self._lean and self._upload_lean(flight, pending):
            return
        arrays: List[Any] = []
        for tf in flight.tables.values():
            arrays.append(_inverse_host(tf.plan.inverse.reshape(-1), self._inv32))
            arrays.append(tf.plan.unique)
        n_tab = len(arrays)
        for _, _, pp, np_ in pending:
            arrays += [np.ascontiguousarray(pp, dtype=np.int64), np.ascontiguousarray(np_, dtype=np.int64)]
        n_idx = len(arrays)
        moved: List[torch.Tensor] = []
        n_away = 0
        if self._cuda and self._to_device:
            moved, n_away = _host_tensors(flight.source, self.device)
            arrays.extend(moved)
        if self._cuda:
            # views only of what is used as a tensor (inverses, moved batch tensors); the
            # unique ids and overlaps go to the fused kernels by address
            hosts = [_as_numpy(a) for a in arrays]
            dev, offsets, event = _upload_buffer(hosts, self.device, self._copy_stream, event=True)
            want = [i for i in range(len(hosts)) if (i < n_tab and i % 2 == 0) or i >= n_idx]
            outs: List[Any] = [None] * len(hosts)
            for i, v in zip(want, _views(dev, [hosts[i] for i in want], [offsets[i] for i in want])):
                outs[i] = v
            for i in range(len(hosts)):
                if outs[i] is None:
                    outs[i] = _DevIds(int(hosts[i].shape[0]), dev=dev, host=hosts[i], off=offsets[i])
        else:
            dev = None
            outs, event = _upload(arrays, self.device, self._copy_stream, event=True)
            for i in range(1, n_idx):
                if i >= n_tab or i % 2 == 1:
                    outs[i] = _DevIds(int(outs[i].shape[0]), t=outs[i])
        for i, (j, name, _, _) in enumerate(pending):
            flight.overlaps.setdefault(j, {})[name] = (outs[n_tab + 2 * i], outs[n_tab + 2 * i + 1])
        for i, tf in enumerate(flight.tables.values()):
            inv = outs[2 * i]
            tf.dev_rows = outs[2 * i + 1]
            if tf.single:
                tf.part_inverse = [inv.view(tf.plan.inverse.shape)]
            else:
                out, start = [], 0
                for shape in tf._shapes:  # type: ignore[attr-defined]
                    n = math.prod(shape)
                    out.append(inv[start:start + n].view(shape))
                    start += n
                tf.part_inverse = out
        if not (self._cuda and self._to_device):
            if self._cuda:
                flight.dev_bufs.append(dev)  # recorded on the compute stream at entry
            _set_aliases(flight.tables.values(), {})
            return
        done: Dict[int, torch.Tensor] = {id(t): o for t, o in zip(moved, outs[n_idx:])}
        copies: List[torch.Tensor] = [dev]  # claimed (recorded) with the batch at entry
        alias: Dict[int, torch.Tensor] = {}
        device = self.device

        def to_device(t: torch.Tensor) -> torch.Tensor:
            if t.device == device:
                return t
            hit = alias.get(id(t))
            if hit is not None:
                return hit
            out = done.get(id(t))
            if out is None:  # not numpy-representable, or on another GPU
                out = _copy_to(t.detach(), device)
                copies.append(out)
            alias[id(t)] = out
            return out

        if len(moved) == n_away:  # everything came with the one upload
            flight.batch = _map_tensors(to_device, flight.source)
        else:
            with on_stream(self._copy_stream):
                flight.batch = _map_tensors(to_device, flight.source)
        if len(copies) > 1:  # copies made beside the upload: the event goes behind them
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        flight.batch_event = event
        flight.copies = copies
        _set_aliases(flight.tables.values(), alias)

    def _upload_lean(self, flight: _Flight, pending: Sequence[Tuple[int, Any, np.ndarray, np.ndarray]]) -> bool:
        """:meth:`_upload` with few torch calls, for the usual batch (CUDA, the compiled
        driver calls, every id array non-empty, every batch tensor on the CPU in a dtype
        numpy holds); False (nothing done) otherwise.

        Layout of the one device buffer: the inverses and the batch's tensors of the
        inverses' dtype (:func:`_inverse_host`) back to back, then the batch's tensors of
        each other dtype (from a 256-byte boundary), then the unique ids and overlaps. So
        every tensor view of the batch comes from one ``unflatten_dense_tensors`` per dtype
        instead of a slice and a reshape each.

        Stream: the copy stream, from this pipeline's own pinned ring (only the issuing
        thread allocates from it). The copy gets no event of its own: :meth:`_gather`
        records ``flight.ready`` behind it right after, and that event guards the ring
        region and is the batch's ``batch_event``.
        """
        calls = driver_calls()
        if calls is None or _UNFLATTEN is None:
            return False
        inv_dt = np.dtype(np.int32) if self._inv32 else np.dtype(np.int64)
        # the inverses' run first: their views come first (below)
        runs: Dict[Any, Tuple[List[np.ndarray], List[torch.Tensor]]] = {inv_dt: ([], [])}
        hosts_inv, temps_inv = runs[inv_dt]
        for tf in flight.tables.values():
            inv = tf.plan.inverse
            if inv.dtype != np.int64 or not inv.flags.c_contiguous or inv.size == 0:
                return False
            h = _inverse_host(inv, self._inv32)
            if h.dtype != inv_dt:
                return False  # int64 kept for 2**31 ids or more: the general path's case
            hosts_inv.append(h)
            if tf.single:
                temps_inv.append(_template(inv.shape))
            else:
                shapes = [tuple(sh) for sh in tf._shapes]  # type: ignore[attr-defined]
                if any(math.prod(sh) == 0 for sh in shapes):
                    return False
                temps_inv.extend(_template(sh) for sh in shapes)
        device = self.device
        if self._to_device:
            moved, n_away = _host_tensors(flight.source, device)
            if len(moved) != n_away:
                return False  # a tensor on another GPU, or of a dtype numpy cannot hold
            for t in moved:
                h = _as_numpy(t)
                if h.size == 0:
                    return False
                run = runs.get(h.dtype)
                if run is None:
                    run = runs[h.dtype] = ([], [])
                run[0].append(h)
                run[1].append(t)
        hosts: List[np.ndarray] = []
        offsets: List[int] = []
        starts: List[int] = []
        off = 0
        for dt, (hs, _) in runs.items():
            off = -(-off // 256) * 256
            starts.append(off)
            for h in hs:
                hosts.append(h)
                offsets.append(off)
                off += h.nbytes
        plain = []  # reached by address only
        for tf in flight.tables.values():
            plain.append(tf.plan.unique)
        for _, _, pp, np_ in pending:
            plain += [np.ascontiguousarray(pp, dtype=np.int64), np.ascontiguousarray(np_, dtype=np.int64)]
        off = -(-off // 256) * 256
        plain_off = []
        for h in plain:
            hosts.append(h)
            offsets.append(off)
            plain_off.append(off)
            off += h.nbytes
        total = max(-(-off // 256) * 256, 256)
        ring = self._issue_ring
        if ring is None:
            ring = self._issue_ring = _Ring(RING_BYTES)
        if total > ring.size // 2:
            return False
        cs = self._copy_stream
        with ring.lock:
            base = ring.alloc(total)
            with on_stream(cs):
                dev = torch.empty(total, dtype=torch.uint8, device=device)
            ptr = dev.data_ptr()
            try:  # packed and copied in one release of the GIL
                err = calls.pack_htod(ring.ptr + base, hosts, offsets, ptr, total, cs.cuda_stream)
            except (ValueError, BufferError):
                return False  # not C-contiguous after all: the general path packs it
            if err != 0:
                with on_stream(cs):
                    dev.copy_(ring.buf[base:base + total], non_blocking=True)
            flight.ring_entry = ring.guard_later(base, base + total, cs)
        views: List[torch.Tensor] = []
        for (dt, (_, temps)), start in zip(runs.items(), starts):
            if not temps:
                continue
            typed = dev.view(_torch_dtype(dt))
            if start:
                typed = typed[start // dt.itemsize:]
            views.extend(_UNFLATTEN(typed, temps))
        i = 0
        for tf in flight.tables.values():
            n = 1 if tf.single else len(tf.parts)
            tf.part_inverse = views[i:i + n]
            i += n
        n_inv = i
        tf_list = list(flight.tables.values())
        for tf, o in zip(tf_list, plain_off):
            tf.dev_rows = _DevIds(int(tf.plan.unique.shape[0]), dev=dev, host=tf.plan.unique, off=o, base=ptr)
        m = len(tf_list)
        for q, (j, name, _, _) in enumerate(pending):
            a, b = plain[m + 2 * q], plain[m + 2 * q + 1]
            flight.overlaps.setdefault(j, {})[name] = (
                _DevIds(int(a.shape[0]), dev=dev, host=a, off=plain_off[m + 2 * q], base=ptr),
                _DevIds(int(b.shape[0]), dev=dev, host=b, off=plain_off[m + 2 * q + 1], base=ptr))
        if not self._to_device:
            flight.dev_bufs.append(dev)  # recorded on the compute stream at entry
            _set_aliases(tf_list, {})
            return True
        done: Dict[int, torch.Tensor] = {}
        for dt, (_, temps) in runs.items():
            if dt == inv_dt:
                temps = temps[n_inv:]  # the views before are the inverses'
            for t in temps:
                done[id(t)] = views[i]
                i += 1
        alias: Dict[int, torch.Tensor] = {}

        def to_device(t: torch.Tensor) -> torch.Tensor:
            out = done.get(id(t))
            if out is None:  # already on the device
                return t
            alias[id(t)] = out
            return out

        flight.batch = _map_tensors(to_device, flight.source)
        flight.copies = [dev]  # claimed (recorded) with the batch at entry
        _set_aliases(tf_list, alias)
        return True

    def _claim_batch(self, flight: _Flight, cur: Any = None, wait: bool = True) -> None:
        """Order the caller's current stream (``cur`` when the caller has it) after the
        batch's copies (no host sync).

        The current stream waits on ``flight.batch_event`` (unless ``wait`` is False: the
        caller made it wait on ``flight.ready``, recorded later on the copy stream) and
        every copy is ``record_stream``-ed on it, once per stream.
        """
        if flight.batch_event is None:
            return
        if cur is None:
            cur = current_stream(self.device)
        if any(s == cur for s in flight.claimed):
            return
        if wait:
            cur.wait_event(flight.batch_event)
        for t in flight.copies:
            t.record_stream(cur)
        flight.claimed.append(cur)

    def _issue(self, flight: _Flight, run: _Run) -> None:
        """Overlaps with the batches in flight (off the lock), the batch's one upload,
        then the gather (under the lock).

        The in-flight set is read once the batch holds a slot: batches leaving after that
        are fixed up into it (their overlap is known); batches that left before wrote the
        host before this gather reads it. Only this thread adds batches to the set.
        """
        idx = flight.index
        run.where = f"computing the overlap of batch {idx} with the batches in flight"
        with self._lock:
            earlier = list(self._inflight.values())
        pending: List[Tuple[int, Any, np.ndarray, np.ndarray]] = []
        for prev in earlier:
            flight.overlaps[prev.index] = {}
            for name, tf in flight.tables.items():
                pp, np_ = overlap(prev.tables[name].plan, tf.plan)
                if len(pp):
                    pending.append((prev.index, name, pp, np_))
        run.where = f"uploading the ids of batch {idx}"
        self._upload(flight, pending)
        run.where = f"gathering batch {idx}"
        with self._lock:
            if run.stop.is_set():
                raise _Stopped()
            self._gather(flight, run)
            self._inflight[idx] = flight

    def _gather(self, flight: _Flight, run: Optional[_Run] = None) -> None:
        """Gather a batch's rows and known state into its slot (issue lock held).

        Stream: the copy stream; records ``flight.ready`` there. On CPU: synchronous.
        """
        cs = self._copy_stream
        pending: List[Any] = []  # fused moves whose one event is recorded below
        moves: List[Any] = []  # launched below, paired
        for name, tf in flight.tables.items():
            if run is not None:
                run.where = f"gathering batch {flight.index}" + ("" if self._single else f" for table {name!r}")
            emb = self.tables[name]
            rs = emb.row_state
            keys = rs.keys if rs is not None else ()
            k = tf.k
            slots = self._slots[name]
            if not slots.fits(flight.slot, k, keys):
                with on_stream(cs) if self._cuda else contextlib.nullcontext():
                    slots.ensure(flight.slot, k, keys, (cs, self._compute_stream))
            if k:
                self._gather_keys(emb, slots, flight.slot, tf, keys, with_rows=True, pending=pending,
                                  moves=moves)
            tf.keys = tuple(keys)
            self.stats["rows_gathered"] += k
        if moves:
            self._launch_paired(moves, _prepare_pair, (cs, pending))
        if self._cuda:
            # one event: the tables' read event and the batch's `ready`
            flight.ready = _finish(pending, cs)
            entry = flight.ring_entry
            if entry is not None:  # a lean upload: `ready` is behind its copy too
                entry[2] = flight.ready
                flight.ring_entry = None
                if flight.copies:
                    flight.batch_event = flight.ready
        self._stage(flight, None if run is None else run.gate)

    def _stage(self, flight: _Flight, gate: Optional[_Gate]) -> None:
        """Make what step entry installs: each table's slot views and forward binding.

        Done with the gather (the prefetch thread at depth >= 1), so the training thread
        only installs them. The views stay valid until the step ends: only this flight
        re-makes its slot (:meth:`_Slots.ensure`), and then makes the views again.
        """
        opened = None if gate is None else (lambda: gate.open(flight.index))
        hold = _HOLD if self._hold_indices else None
        for name, tf in flight.tables.items():
            tf.views = self._slots[name].views(flight.slot, tf.k, tf.keys)
            if hold is not None:
                tf.holds = [hold(inv) for inv in tf.part_inverse]
            tf.binding = _Binding(parts=[_Part(ids=x, inverse=inv, alias=a, version=_version(x),
                                               alias_version=_version(a))
                                         for x, inv, a in zip(tf.parts, tf.part_inverse,
                                                              tf.aliases or [None] * len(tf.parts))],
                                  unique=tf.plan.unique, on_lookup=opened,
                                  outputs=[] if self._hold_outputs else None,
                                  outputs_room=_HOLD_OUTPUT_BYTES)

    def _gather_keys(self, emb: HostEmbedding, slots: _Slots, slot: int, tf: _TableFlight,
                     keys: Sequence[str], with_rows: bool, pending: Optional[list] = None,
                     moves: Optional[list] = None) -> None:
        """Gather rows (``with_rows``) and state ``keys`` of ``tf``'s unique ids into the
        slot: the stacked ones by one fused call (:func:`stpipe.host.gather_many`), the
        others one by one. Stream: the copy stream. ``pending``: see
        :func:`stpipe.host._move_many`. ``moves``: a list that takes the prepared fused
        move as ``(move, (ids address, n))`` instead of launching it (the caller launches
        it with :meth:`_launch_paired`, before anything else reads the slot)."""
        k = tf.k
        rs = emb.row_state
        stacked = slots.stacked_among(slot, keys)
        if with_rows or stacked:
            lo = 0 if with_rows else 1
            tables = ([emb.table] + [rs.tables[key] for key in stacked])[lo:]
            move = slots.move(slot, "gather", lo, tables) if self._cuda else None
            if move is not None and moves is not None:
                moves.append((move, (tf.dev_rows.ptr, k)))
            elif move is not None:
                move(tf.dev_rows.ptr, k, self._copy_stream, pending)
            else:
                self._rows_on_device(tf)
                planes = slots.stack[slot][lo:1 + len(stacked), :k]
                _gather_many(tables, tf.rows, planes, stream=self._copy_stream, pending=pending)
        for key in keys:
            if key not in stacked:
                self._rows_on_device(tf)
                out = slots.state(slot, key, k)
                rs.tables[key].gather(tf.rows, out=out, stream=self._copy_stream)

    def _rows_on_device(self, tf: _TableFlight) -> None:
        """Give ``tf.rows`` its uploaded device ids (a view, made only for the paths
        that take an IndexBatch instead of an address)."""
        if self._cuda and tf.rows.device_ids is None and tf.dev_rows is not None:
            tf.rows.device_ids = tf.dev_rows.tensor()

    def _drop(self, flight: _Flight, run: _Run) -> None:
        """Forget a batch that will not be trained (never entered)."""
        if run.gate is not None:
            run.gate.open(flight.index)
        with self._lock:
            self._inflight.pop(flight.index, None)
        if flight.slot >= 0:
            run.free(flight.slot)
            flight.slot = -1

    # ------------------------------------------------------------ training thread
    def _enter(self, step: Step) -> None:
        run = self._run
        if run is None or run.closed:
            raise StpipeRuntimeError(f"step {step.index} belongs to a run that has ended")
        f = step._flight
        if f.slot < 0:  # given back when the loop moved past it (:meth:`_deliver`)
            raise StpipeRuntimeError(
                f"step {step.index} was skipped: the loop took the next step (or its run "
                "ended) before it was entered, so its rows are gone; enter each step "
                "(`with step:`) before taking the next"
            )
        t0 = time.perf_counter()
        for name, emb in self.tables.items():
            rs = emb.row_state
            if rs is None:
                continue
            if not rs.discovered:
                # an optimizer that creates its state in __init__ (Adagrad) has it before
                # any step
                if rs.optimizer.state.get(emb.weight):
                    with self._lock:
                        rs.discover()
            elif rs.scalar_keys and not rs.optimizer.state.get(emb.weight):
                # scalar state gone (Adam's `step`): the optimizer would fail on the
                # per-row views alone (an optimizer without scalar state, e.g. SGD's
                # momentum, has none after a checkpoint's load, and reads its per-row
                # state as usual)
                raise StpipeRuntimeError(
                    f"{type(rs.optimizer).__name__} holds no state for table {name!r} any "
                    "more (optimizer.state was cleared, or optimizer.load_state_dict gave "
                    "it none); its per-row state lives in host tables, which stpipe moves "
                    "with the rows: restore a run with pipe.load_checkpoint / "
                    "emb.load_checkpoint, or start afresh with a new Pipeline, optimizer "
                    f"and tables; step {step.index} was not entered"
                )
        cs = self._copy_stream
        compute = current_stream(self.device) if self._cuda else None
        self._compute_stream = compute
        step._compute_stream = compute
        # state keys discovered after this batch was gathered: gather them now (the host
        # is up to date: every earlier step has issued its write-back)
        late = {name: [k for k in (self.tables[name].row_state.keys if self.tables[name].row_state else ())
                       if k not in tf.keys]
                for name, tf in f.tables.items()}
        if any(late.values()):
            with self._lock:
                ctx = on_stream(cs) if self._cuda else contextlib.nullcontext()
                with ctx:
                    for name, keys in late.items():
                        if not keys:
                            continue
                        tf = f.tables[name]
                        emb = self.tables[name]
                        slots = self._slots[name]
                        slots.ensure(f.slot, tf.k, emb.row_state.keys, (cs, compute))
                        if tf.k:
                            self._gather_keys(emb, slots, f.slot, tf, keys, with_rows=False)
                        tf.keys = tuple(emb.row_state.keys)
                        tf.views = None  # the slot may be new: views made below
                    if self._cuda:
                        f.ready = torch.cuda.Event()
                        f.ready.record(cs)
        if self._cuda:
            if self._profile:
                f.ready.synchronize()
            compute.wait_event(f.ready)
            self._claim_batch(f, compute, wait=False)  # ready is behind the batch's copy
            for buf in f.dev_bufs:  # uploaded ids not claimed with the batch (used on compute)
                buf.record_stream(compute)
        tables = self.tables
        for name, tf in f.tables.items():
            if tf.views is None:
                tf.views = self._slots[name].views(f.slot, tf.k, tf.keys)
            rows, states = tf.views
            emb = tables[name]
            _set_working(emb.weight, rows)
            rs = emb.row_state
            if rs is not None:
                step._snaps[name] = rs.snapshot()
                rs.install(states)
            emb._bind(tf.binding)
        step._opt_steps = self._opt_steps
        t1 = time.perf_counter()
        step._t_enter = t1
        if self._profile:
            step.record = {"index": f.index, "plan_ms": f.plan_s * 1e3, "wait_ms": (t1 - t0) * 1e3}

    def _exit(self, step: Step, failed: bool) -> None:
        run = self._run
        f = step._flight
        compute = step._compute_stream
        for emb in self.tables.values():
            emb._bind(None)
        for tf in f.tables.values():  # the step's lookups are done with
            tf.holds = []
            if tf.binding is not None and tf.binding.outputs:
                tf.binding.outputs = []
        if run is not None and run.gate is not None:
            run.gate.open(f.index)  # a step without lookups, or one that failed
        err: Optional[BaseException] = None
        if not failed:
            try:
                for emb in self.tables.values():
                    if emb.row_state is not None:
                        emb.row_state.discover()
            except BaseException as exc:  # unsplittable state: the step fails
                err = exc
                failed = True
        if failed:
            self._fail(step, run)
            if err is not None:
                raise err
            return
        if self._profile and self._cuda:
            compute.synchronize()
        t1 = time.perf_counter()
        try:
            self._write_back(step)
        except BaseException:
            # refused by its checks: nothing written, the step failed; else a failure
            # issuing copies (a CUDA error): part may be written, the slot is freed so
            # that nothing hangs, the scalar state stays
            self._fail(step, run, restore=not step._issued)
            raise
        if self._profile:
            if self._cuda:
                self._copy_stream.synchronize()
            t2 = time.perf_counter()
            step.record.update(compute_ms=(t1 - step._t_enter) * 1e3, writeback_ms=(t2 - t1) * 1e3)
            self.profile.append(step.record)
        self.stats["steps"] += 1
        if (self._optimizers and not self._warned_unapplied and self._opt_steps == step._opt_steps
                and any(emb.weight.grad is not None for emb in self.tables.values())):
            self._warned_unapplied = True
            warnings.warn(
                f"step {f.index} ended with a gradient on a table's working rows and no "
                "optimizer step: it is dropped (said once per pipeline). stpipe applies a "
                "table's gradient only inside its step: call opt.step() within `with step:`; "
                "gradients do not accumulate across steps (a step skipped on purpose, e.g. by "
                "GradScaler on inf gradients, needs nothing)",
                RuntimeWarning,
                stacklevel=3,
            )
        for emb in self.tables.values():
            _set_idle(emb.weight)
        if run is not None and not run.closed:
            run.free(f.slot)
        f.slot = -1
        if run is None or run.closed:
            self.synchronize()

    def _fail(self, step: Step, run: Optional[_Run], restore: bool = True) -> None:
        """Leave a step by exception: no write-back, restore scalar optimizer state
        (unless ``restore`` is False), give the slot back."""
        f = step._flight
        for name, emb in self.tables.items() if restore else ():
            rs = emb.row_state
            if rs is not None and name in step._snaps:
                rs.restore(step._snaps[name])
        for emb in self.tables.values():
            _set_idle(emb.weight)
        with self._lock:
            if self._cuda:
                done = torch.cuda.Event()
                done.record(step._compute_stream)
                self._copy_stream.wait_event(done)  # the slot's next gather waits for our compute
            self._inflight.pop(f.index, None)
        if run is not None and not run.closed:
            run.free(f.slot)
        f.slot = -1
        self.stats["failed"] += 1

    def _write_back(self, step: Step) -> None:
        """Fix up the batches in flight and scatter this step's rows and state.

        Stream: the copy stream, after ``done`` recorded on the compute stream; the
        training thread does not wait. Under the issue lock, so every gather is issued
        either before it (and fixed up here) or after it (and reads the written host).

        The checks come first (the optimizer still holds every state key, ``emb.weight``
        still has the step's shape): one that fails raises before anything is written,
        and :meth:`_exit` fails the step as if the user's code had raised.
        """
        f = step._flight
        cs = self._copy_stream
        compute = step._compute_stream
        # make sure the slot holds what the optimizer produced (compute stream)
        views: Dict[Any, Tuple[torch.Tensor, Dict[str, torch.Tensor]]] = {}
        for name, tf in f.tables.items():
            emb = self.tables[name]
            slots = self._slots[name]
            k = tf.k
            rs = emb.row_state
            keys = rs.keys if rs is not None else ()
            cached = tf.views
            if keys and keys != tf.keys and any(key not in tf.keys for key in keys):
                slots.ensure(f.slot, k, keys, (cs, compute))  # keys discovered this step
                cached = None
            rows = cached[0] if cached is not None else slots.rows(f.slot, k)
            w = emb.weight
            if w.data_ptr() != rows.data_ptr() or w.shape != rows.shape:
                if w.shape != rows.shape:
                    raise StpipeRuntimeError(
                        f"emb.weight was replaced during step {f.index} by a tensor of shape "
                        f"{tuple(w.shape)}; expected the step's rows {tuple(rows.shape)}"
                    )
                rows.copy_(w.detach())
            sv = {}
            state = rs._state() if keys else None
            for key in keys:
                buf = cached[1][key] if cached is not None else slots.state(f.slot, key, k)
                cur = state.get(key) if state is not None else None
                if cur is not buf:  # the optimizer no longer holds the installed view
                    if cur is None:
                        cur = rs.current(key)  # raises: the key is gone
                    if cur.data_ptr() != buf.data_ptr() or cur.shape != buf.shape:
                        buf.copy_(cur)
                sv[key] = buf
            views[name] = (rows, sv)
        step._issued = True
        with self._lock:
            if self._cuda:
                done = self._done_ev
                if done is None:
                    done = self._done_ev = torch.cuda.Event()
                done.record(compute)  # a wait already enqueued keeps the record it saw
                cs.wait_event(done)
            carries = []
            for j in sorted(j for j in self._inflight if j > f.index):
                g = self._inflight[j]
                ov = g.overlaps.get(f.index)
                if ov:
                    carries.append((g, ov))
            if carries:
                for g, ov in carries:
                    launches: List[Any] = []
                    for name, (pp, np_) in ov.items():
                        self._carry(name, f, g, pp, np_, launches)
                        self.stats["rows_carried"] += pp.n
                    if launches:
                        self._launch_paired(launches, _pair_carries, (cs,))
                    if self._cuda:
                        # re-recorded, later on the same stream: whatever else holds
                        # it (batch_event, a read event, a ring guard) stays valid
                        if g.ready is None:
                            g.ready = torch.cuda.Event()
                        g.ready.record(cs)
            pending: List[Any] = []  # fused scatters: one write event for all tables
            moves: List[Any] = []  # launched below, paired
            for name, tf in f.tables.items():
                if not tf.k:
                    continue
                emb = self.tables[name]
                rows, sv = views[name]
                slots = self._slots[name]
                stacked = slots.stacked_among(f.slot, sv)
                tables = [emb.table] + [emb.row_state.tables[key] for key in stacked]
                move = slots.move(f.slot, "scatter", 0, tables) if self._cuda else None
                if move is not None:
                    moves.append((move, (tf.dev_rows.ptr, tf.k)))
                else:
                    self._rows_on_device(tf)
                    planes = slots.stack[f.slot][: len(tables), : tf.k]
                    _scatter_many(tables, tf.rows, planes, stream=cs, pending=pending)
                for key, buf in sv.items():
                    if key not in stacked:
                        self._rows_on_device(tf)
                        emb.row_state.tables[key].scatter(tf.rows, buf, stream=cs, assume_unique=True)
            if moves:
                self._launch_paired(moves, _prepare_pair, (cs, pending))
            if pending:
                if self._wb_ev is None:
                    self._wb_ev = torch.cuda.Event()
                _finish(pending, cs, self._wb_ev)
            self._inflight.pop(f.index, None)

    def _carry(self, name: Any, f: _Flight, g: _Flight, pp: _DevIds, np_: _DevIds,
               launches: list) -> None:
        """Copy the rows (and state) batch ``g`` shares with ``f`` from ``f``'s slot into
        ``g``'s: ``g[np_] = f[pp]`` for the planes both hold (issue lock held; stream: the
        copy stream, after ``f``'s compute: the carry kernel is given it, the torch
        fallbacks make it current). ``launches`` takes the prepared carry kernel's call as
        ``(carry, (from address, to address, n))``, one launch for all its planes; the
        caller launches it with :meth:`_launch_paired` before recording ``g``'s ready
        event (the torch fallbacks below write other planes or buffers, so the order
        between them does not matter)."""
        slots = self._slots[name]
        ftf, gtf = f.tables[name], g.tables[name]
        keys = gtf.keys  # f's slot holds every known key (ensured in its write-back)
        sf = [key for key in slots.stacked[f.slot] if key in keys]
        sg = [key for key in slots.stacked[g.slot] if key in keys]
        m = 0
        while m < min(len(sf), len(sg)) and sf[m] == sg[m]:
            m += 1
        src, dst = slots.stack[f.slot], slots.stack[g.slot]
        carry = slots.carry(f.slot, g.slot, 1 + m) if self._cuda else None
        if carry is not None:
            launches.append((carry, (pp.ptr, np_.ptr, pp.n)))
        else:
            pt, nt = pp.tensor(), np_.tensor()
            with on_stream(self._copy_stream) if self._cuda else contextlib.nullcontext():
                dst[: 1 + m].index_copy_(1, nt, src[: 1 + m, : ftf.k].index_select(1, pt))
        rest = [key for key in keys if key not in sf[:m]]
        if rest:
            with on_stream(self._copy_stream) if self._cuda else contextlib.nullcontext():
                for key in rest:
                    d = slots.state(g.slot, key, gtf.k)
                    d.index_copy_(0, np_.tensor(), slots.state(f.slot, key, ftf.k).index_select(0, pp.tensor()))

    def _paired(self, a: Any, b: Any, make: Callable[[Any, Any], Any]) -> Any:
        """``make(a, b)`` (a paired launch of two prepared ones, or ``None``), made once per
        pair of prepared objects (issue lock held). The cache holds ``a`` and ``b``, so
        their ids name them while cached; it is emptied past :data:`_PAIRS_MAX` entries
        (prepared objects are replaced when a slot grows)."""
        key = (id(a), id(b))
        hit = self._pairs.get(key)
        if hit is not None and hit[0] is a and hit[1] is b:
            return hit[2]
        if len(self._pairs) >= _PAIRS_MAX:
            self._pairs.clear()
        pair = make(a, b)
        self._pairs[key] = (a, b, pair)
        return pair

    def _launch_paired(self, calls: List[Tuple[Any, Tuple[int, ...]]], make: Callable[[Any, Any], Any],
                       tail: Tuple[Any, ...]) -> None:
        """Make the prepared launches ``calls`` (``[(prepared, args)]``, one per table, one
        kind) in order, two tables' as one where ``make`` pairs them (cached,
        :meth:`_paired`): ``prepared(*args, *tail)`` alone, ``pair(*args, *args2, *tail)``
        paired. Issue lock held; the stream is in ``tail``."""
        i, count = 0, len(calls)
        while i < count:
            fn, args = calls[i]
            if self._pair and i + 1 < count:
                fn2, args2 = calls[i + 1]
                pair = self._paired(fn, fn2, make)
                if pair is not None:
                    pair(*args, *args2, *tail)
                    i += 2
                    continue
            fn(*args, *tail)
            i += 1


def _inverse_host(inv: np.ndarray, narrow: bool) -> np.ndarray:
    """A plan's inverse as the lookups take it on the device: int32 where ``narrow`` (and
    the batch has fewer than 2**31 ids), else int64; C-contiguous.

    Why int32: ``torch.embedding``'s CUDA backward sorts the lookup's indices (CUB radix
    sort over every bit of the index type) once a lookup has more than 3072 of them, so
    int32 indices take half the sort passes of int64 ones. The gradient is the same bit
    for bit: the sort is stable and the rows' sums run in the same order. Half the bytes
    to upload, too. The conversion is one numpy pass on the prefetch thread.
    """
    if narrow and inv.size < 2**31:
        return inv.astype(np.int32, order="C")
    return np.ascontiguousarray(inv, dtype=np.int64)


def _pair_carries(a: Any, b: Any) -> Any:
    """Two prepared carries as one launch, or ``None`` (``CupyBackend.prepare_carry_pair``)."""
    backend = getattr(a, "_backend", None)
    prepare = getattr(backend, "prepare_carry_pair", None)
    return prepare(a, b) if prepare is not None else None


def _make_hold() -> Optional[Callable[[torch.Tensor], Any]]:
    """What :meth:`Pipeline._stage` holds each lookup's index tensor with, or None.

    Why: in PyTorch's PyObject preservation (``c10/util/intrusive_ptr.h``) a tensor that
    Python has seen increfs its PyObject when its C++ reference count goes from 1 to 2 and
    decrefs it when the count goes back to 1, both under the GIL. The lookup's
    ``EmbeddingBackward`` node saves the index tensor (count 2: the PyObject and the
    node) and releases it in ``backward()``, on autograd's device thread: 2 -> 1, so that
    thread takes the GIL once per lookup, and waits there while the prefetch thread holds
    it. A DLPack capsule holds one more C++ reference for the step (no copy, no stream
    work), so the release goes 3 -> 2 and takes no GIL; the capsule is dropped at the
    step's exit, by the training thread, which holds the GIL anyway. The lookups' outputs
    are held the same way, by a view of each (:class:`stpipe.embedding._Binding`
    ``outputs``; DLPack refuses tensors that require grad): a loss's ``einsum``/``bmm``
    saves views of them, and releasing such a view releases its base. Measured in
    benchmarks/RESULTS.md (stop 35): the skip-gram step's backward() takes the GIL on
    autograd's thread 8 times without the holds; 5 with the index holds (H100 and CPU);
    2 with both (the loss's own; counted on the CPU). Depth 1 was 0.09 ms per step faster
    with both than with none, in 16 of 20 paired blocks on an H100 host.
    """
    try:
        from torch.utils.dlpack import to_dlpack

        to_dlpack(torch.zeros(2, dtype=torch.int64))
    except Exception:  # noqa: BLE001 - an optimisation only: no hold
        return None
    return to_dlpack


#: see :func:`_make_hold`
_HOLD = _make_hold()
#: at most this many bytes of one table's lookup outputs are held per step (the skip-gram
#: benchmark's step holds 17 MB); lookups past it are not held, only not sped up
_HOLD_OUTPUT_BYTES = 256 << 20


def _set_working(param: torch.Tensor, view: torch.Tensor) -> None:
    """Make ``param`` the working rows ``view`` ``(k, dim)`` and clear its gradient.

    Autograd caches a leaf's gradient accumulator (with the leaf's shape) for as long as a
    graph that used it is alive (e.g. the previous step's ``loss``); ``.data =`` with a
    new *shape* keeps that stale accumulator, and the next backward fails with "expected
    shape compatible with [k_old, dim]". A change of dtype resets it, so the parameter
    passes through an empty tensor of another dtype first.
    """
    param.grad = None
    param.data = _other_empty(view)
    param.data = view


#: tables of pipelines built without an optimizer: ``emb -> name`` (weak)
_UNBOUND: "weakref.WeakKeyDictionary[HostEmbedding, Any]" = weakref.WeakKeyDictionary()
_UNBOUND_HOOK: Any = None


def _watch_unbound(tables: Iterable[Tuple[Any, HostEmbedding]]) -> None:
    """Check every optimizer step for per-row state of these tables' working rows (see
    :func:`_check_unbound`); torch's global step hook is registered once."""
    global _UNBOUND_HOOK
    for name, emb in tables:
        _UNBOUND[emb] = name
    if _UNBOUND_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _UNBOUND_HOOK = register_optimizer_step_post_hook(_check_unbound)


def _check_unbound(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After any ``optimizer.step()``: refuse per-row state for a table's working rows
    held by an optimizer the table's pipeline was not given. That state would stay with
    the positions of the working rows, i.e. go to other rows at the next step.

    Raised inside the user's step, it fails the step: nothing is written back.
    """
    if not _UNBOUND:
        return
    state = optimizer.state
    for emb, name in list(_UNBOUND.items()):
        rs = emb.row_state
        if rs is not None and rs.optimizer is optimizer:
            continue
        w = emb.weight
        if w not in state:
            continue
        keys = [k for k, v in state[w].items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        if keys:
            raise StpipeRuntimeError(
                f"{type(optimizer).__name__} keeps per-row state {keys} for table {name!r}, "
                "but its Pipeline was built without this optimizer: that state would stay "
                "with the positions of the working rows, not with the rows; pass it as "
                "Pipeline(..., optimizer=opt)"
            )


def _set_idle(param: torch.Tensor) -> None:
    """Make ``param`` the idle working parameter ``(0, dim)`` without a gradient.

    What it is between steps. The slot its rows viewed goes to a later batch once the
    step is over; an ``optimizer.step()`` after the step's exit (a gradient-accumulation
    loop stepping outside ``with step:``) then finds no gradient and changes nothing,
    at every depth, instead of updating that batch's freshly gathered rows.
    """
    param.grad = None
    param.data = _empty((0, int(param.shape[-1])), param.dtype, param.device)


def _other_empty(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor on ``t``'s device of a dtype other than ``t``'s (cached): what
    ``param.data`` passes through to drop autograd's cached gradient accumulator."""
    return _empty((0,), torch.float64 if t.dtype != torch.float64 else torch.float32, t.device)


def _empty(shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty tensor of ``shape`` (one dimension 0), cached per shape, dtype and device
    (they are assigned to parameters' ``.data`` every step, so no allocation there)."""
    key = (shape, dtype, device)
    empty = _EMPTY.get(key)
    if empty is None:
        empty = _EMPTY.setdefault(key, torch.empty(shape, dtype=dtype, device=device))
    return empty


#: see :func:`_empty`
_EMPTY: Dict[Tuple[Tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = {}


class _Stopped(Exception):
    """Internal: the run was stopped while the prefetch thread worked."""

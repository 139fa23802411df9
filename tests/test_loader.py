"""CPU tests of :mod:`stpipe.loader`: structure, len, closing, errors, arguments.

On a CPU target the prefetch thread runs with no copies, so the thread machinery
(bounded queue, stop, join, error delivery, GC) is exercised here without a GPU.
"""
from __future__ import annotations

import collections
import dataclasses
import gc
import threading
import time
import warnings
import weakref
from typing import Any, Iterator, List, NamedTuple, Optional

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stpipe._errors import StpipeRuntimeError, StpipeTypeError, StpipeValueError
from stpipe.loader import Prefetcher, _map_tensors, prefetch


def _prefetch_threads() -> List[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("stpipe-prefetch-") and t.is_alive()]


@pytest.fixture(autouse=True)
def no_thread_leak():
    """Every test must leave no prefetch thread behind."""
    yield
    if _prefetch_threads():
        gc.collect()
    deadline = time.monotonic() + 2.0
    while _prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _prefetch_threads() == []


class Pair(NamedTuple):
    x: torch.Tensor
    tag: str


@dataclasses.dataclass
class Sample:
    ids: torch.Tensor
    weight: float
    extra: dict


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: torch.Tensor
    b: Optional[torch.Tensor] = None
    derived: int = dataclasses.field(init=False, default=7)


def _nested(i: int) -> dict:
    return {
        "x": torch.full((2, 3), float(i)),
        "list": [torch.arange(i + 1), "text", 3],
        "tuple": (torch.ones(1) * i, None),
        "pair": Pair(torch.tensor([i]), tag=f"t{i}"),
        "sample": Sample(torch.tensor([i, i]), 0.5, {"y": torch.zeros(i + 1)}),
        "frozen": Frozen(torch.tensor(float(i))),
        "np": np.arange(3),
        "od": collections.OrderedDict(k=torch.tensor([i])),
        "dd": collections.defaultdict(list, k=torch.tensor([i])),
    }


def _check_same(a: Any, b: Any) -> None:
    """Structural equality with tensors compared by value and types compared exactly."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _check_same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _check_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _check_same(x, y)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    else:
        assert a == b


# ------------------------------------------------------------------------ _map_tensors


def test_map_tensors_keeps_structure_and_leaves():
    batch = _nested(3)
    out = _map_tensors(lambda t: t + 1, batch)
    assert out is not batch
    assert out["list"][1:] == ["text", 3]
    assert out["tuple"][1] is None
    assert isinstance(out["pair"], Pair) and out["pair"].tag == "t3"
    assert isinstance(out["sample"], Sample) and out["sample"].weight == 0.5
    assert isinstance(out["frozen"], Frozen) and out["frozen"].derived == 7
    assert out["np"] is batch["np"]
    assert type(out["od"]) is collections.OrderedDict
    assert type(out["dd"]) is collections.defaultdict and out["dd"].default_factory is list
    torch.testing.assert_close(out["x"], batch["x"] + 1)
    torch.testing.assert_close(out["sample"].extra["y"], batch["sample"].extra["y"] + 1)
    torch.testing.assert_close(out["frozen"].a, batch["frozen"].a + 1)
    # the input is untouched
    _check_same(batch, _nested(3))


def test_map_tensors_leaf_and_plain_tensor():
    t = torch.ones(2)
    assert _map_tensors(lambda x: x * 2, t).tolist() == [2.0, 2.0]
    for leaf in (None, 3, "s", b"b", 1.5, np.zeros(2)):
        assert _map_tensors(lambda x: x * 2, leaf) is leaf


def test_map_tensors_does_not_rerun_post_init():
    calls = []

    @dataclasses.dataclass
    class Checked:
        t: torch.Tensor

        def __post_init__(self):
            calls.append(1)

    c = Checked(torch.zeros(1))
    out = _map_tensors(lambda x: x + 1, c)
    assert calls == [1] and out.t.item() == 1.0 and c.t.item() == 0.0


def test_map_tensors_list_and_tuple_subclasses():
    class MyList(list):
        pass

    out = _map_tensors(lambda x: x + 1, MyList([torch.zeros(1), "a"]))
    assert type(out) is MyList and out[0].item() == 1.0 and out[1] == "a"
    size = _map_tensors(lambda x: x, torch.Size([2, 3]))
    assert size == torch.Size([2, 3])


def test_map_tensors_never_modifies_a_mapping_it_rebuilds():
    """A mutable mapping that keeps its items in an inner dict (its shallow copy would
    share them) is rebuilt, not copied and updated; dict subclasses and UserDict keep
    their type and extras. The input holds its own tensors afterwards."""
    class Wrapper(collections.abc.MutableMapping):
        def __init__(self, items=()):
            self._d = dict(items)

        def __getitem__(self, k):
            return self._d[k]

        def __setitem__(self, k, v):
            self._d[k] = v

        def __delitem__(self, k):
            del self._d[k]

        def __iter__(self):
            return iter(self._d)

        def __len__(self):
            return len(self._d)

    class KwOnly(Wrapper):
        def __init__(self, **kw):
            super().__init__(kw)

    dd = collections.defaultdict(list)
    for batch in (Wrapper({"x": torch.zeros(2)}), KwOnly(x=torch.zeros(2)),
                  collections.UserDict(x=torch.zeros(2)), collections.OrderedDict(x=torch.zeros(2)), dd):
        batch["x"] = torch.zeros(2)
        x = batch["x"]
        out = _map_tensors(lambda t: t + 1, batch)
        assert batch["x"] is x and x.tolist() == [0.0, 0.0]
        assert out["x"].tolist() == [1.0, 1.0]
        assert type(out) is (dict if isinstance(batch, KwOnly) else type(batch))
    assert out.default_factory is list


def test_cpu_0_is_the_cpu():
    """"cpu:0" names the CPU: batches pass through as they are (CPU tensors report "cpu")."""
    x = torch.ones(3)
    p = prefetch([{"x": x}], "cpu:0")
    assert p.device == torch.device("cpu")
    assert [b["x"] is x for b in p] == [True]


_leaves = st.one_of(
    st.none(), st.integers(), st.text(max_size=3),
    st.lists(st.floats(-5, 5), max_size=4).map(torch.tensor),
)
_trees = st.recursive(
    _leaves,
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.lists(kids, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=2), kids, max_size=3),
    ),
    max_leaves=12,
)


@settings(max_examples=50, deadline=None)
@given(_trees)
def test_map_tensors_identity_roundtrip(tree):
    _check_same(_map_tensors(lambda t: t.clone(), tree), tree)


# ------------------------------------------------------------------------ iteration


def test_cpu_batches_pass_through_with_structure():
    batches = [_nested(i) for i in range(5)]
    out = list(prefetch(batches, "cpu"))
    assert len(out) == 5
    for got, want in zip(out, batches):
        _check_same(got, want)
        assert got["x"] is want["x"]  # CPU target: no copy


def test_generator_input():
    def gen() -> Iterator[torch.Tensor]:
        for i in range(7):
            yield torch.tensor([i])

    assert [b.item() for b in prefetch(gen(), "cpu")] == list(range(7))


def test_iterator_and_dataloader_input():
    ds = torch.utils.data.TensorDataset(torch.arange(10).float(), torch.arange(10))
    loader = torch.utils.data.DataLoader(ds, batch_size=3)
    out = list(prefetch(loader, "cpu", depth=1))
    assert [y.tolist() for _, y in out] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert [b.item() for b in prefetch(iter([torch.tensor(1), torch.tensor(2)]), "cpu")] == [1, 2]


@pytest.mark.parametrize("depth", [1, 2, 5], ids=lambda d: f"depth{d}")
def test_order_and_count(depth):
    out = [b.item() for b in prefetch((torch.tensor(i) for i in range(50)), "cpu", depth=depth)]
    assert out == list(range(50))


def test_empty_loader():
    p = prefetch([], "cpu")
    with pytest.raises(StopIteration):
        next(p)
    assert p.closed
    assert list(prefetch(iter(()), "cpu")) == []


def test_len_passthrough():
    assert len(prefetch([1, 2, 3], "cpu")) == 3
    loader = torch.utils.data.DataLoader(torch.arange(10), batch_size=4)
    assert len(prefetch(loader, "cpu")) == 3
    with pytest.raises(TypeError, match="no len"):
        len(prefetch((i for i in range(3)), "cpu"))


def test_len_does_not_start_thread():
    p = prefetch([1, 2], "cpu")
    len(p)
    assert p.thread is None and _prefetch_threads() == []


def test_next_after_exhaustion_and_close():
    p = prefetch([torch.zeros(1)], "cpu")
    assert len(list(p)) == 1
    with pytest.raises(StopIteration):
        next(p)
    p.close()
    p.close()  # idempotent


# ------------------------------------------------------------------------ closing


def _endless() -> Iterator[torch.Tensor]:
    i = 0
    while True:
        yield torch.tensor([i])
        i += 1


def test_close_early_stops_thread():
    p = prefetch(_endless(), "cpu", depth=2)
    it = iter(p)
    for i, b in enumerate(it):
        if i == 3:
            break
    thread = p.thread
    assert thread is not None and thread.name.startswith("stpipe-prefetch-") and thread.daemon
    p.close()
    assert not thread.is_alive()
    assert thread not in threading.enumerate()
    with pytest.raises(StopIteration):
        next(p)


def test_break_then_gc_stops_thread():
    def run() -> threading.Thread:
        p = prefetch(_endless(), "cpu")
        for _ in p:
            break
        return p.thread

    thread = run()  # the Prefetcher is unreachable now
    gc.collect()
    thread.join(timeout=2)
    assert not thread.is_alive()


def test_for_loop_break_without_reference():
    for b in prefetch(_endless(), "cpu"):
        assert b.item() == 0
        break
    # no explicit close: the fixture checks that no thread survives collection


def test_context_manager_closes():
    with prefetch(_endless(), "cpu") as p:
        assert next(p).item() == 0
        thread = p.thread
    assert p.closed and not thread.is_alive()


def test_prefetcher_is_collectable_while_thread_runs():
    p = prefetch(_endless(), "cpu")
    next(p)
    ref = weakref.ref(p)
    thread = p.thread
    del p
    gc.collect()
    assert ref() is None
    thread.join(timeout=2)
    assert not thread.is_alive()


def test_close_while_loader_is_slow():
    def slow() -> Iterator[int]:
        for i in range(100):
            time.sleep(0.05)
            yield i

    p = prefetch(slow(), "cpu")
    assert next(p) == 0
    t0 = time.monotonic()
    p.close()
    assert time.monotonic() - t0 < 2.0
    assert not p.thread.is_alive()


def test_close_before_start_is_fine():
    p = prefetch(_endless(), "cpu")
    p.close()
    assert p.thread is None
    with pytest.raises(StopIteration):
        next(p)


def test_queue_is_bounded():
    fetched = []

    def counting() -> Iterator[int]:
        for i in range(100):
            fetched.append(i)
            yield i

    with prefetch(counting(), "cpu", depth=2) as p:
        next(p)
        deadline = time.monotonic() + 10  # give a loaded machine time to fill the queue
        while len(fetched) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # then a while longer: the thread must stop there
        # depth queued + one waiting for room + the one handed out
        assert len(fetched) == 2 + 2


# ------------------------------------------------------------------------ errors


def test_loader_exception_reraised_at_its_batch():
    def failing() -> Iterator[torch.Tensor]:
        for i in range(3):
            yield torch.tensor([i])
        raise ValueError("bad record 42")

    got = []
    p = prefetch(failing(), "cpu")
    with pytest.raises(StpipeRuntimeError, match=r"batch 3 .*fetching it from the loader") as info:
        for b in p:
            got.append(b.item())
    assert got == [0, 1, 2]  # every batch before the failure was delivered
    err = info.value
    assert isinstance(err, RuntimeError)
    assert isinstance(err.__cause__, ValueError) and "bad record 42" in str(err)
    assert err.__cause__.__traceback__ is not None  # the thread's traceback is kept
    notes = getattr(err.__cause__, "__notes__", [])
    assert any("stpipe-prefetch-" in n and "batch 3" in n for n in notes)
    assert p.closed and not p.thread.is_alive()


def test_loader_exception_on_first_batch():
    def failing() -> Iterator[int]:
        raise KeyError("nope")
        yield 0  # pragma: no cover

    with pytest.raises(StpipeRuntimeError, match="batch 0") as info:
        next(prefetch(failing(), "cpu"))
    assert isinstance(info.value.__cause__, KeyError)


def test_iter_error_raised_directly():
    class BadIterable:
        def __iter__(self):
            raise OSError("cannot open shard")

    with pytest.raises(OSError, match="shard"):
        next(prefetch(BadIterable(), "cpu"))


# ------------------------------------------------------------------------ arguments


@pytest.mark.parametrize("depth", [0, -1], ids=["zero", "negative"])
def test_depth_below_one_is_value_error(depth):
    with pytest.raises(ValueError, match="depth must be >= 1") as info:
        prefetch([1], "cpu", depth=depth)
    assert isinstance(info.value, StpipeValueError)


@pytest.mark.parametrize("depth", [1.5, True, "2"], ids=["float", "bool", "str"])
def test_depth_wrong_type(depth):
    with pytest.raises(StpipeTypeError):
        prefetch([1], "cpu", depth=depth)


def test_not_iterable_and_bad_device():
    with pytest.raises(StpipeTypeError, match="iterable"):
        prefetch(42, "cpu")
    with pytest.raises(StpipeTypeError, match="device"):
        prefetch([1], 1.0)
    with pytest.raises(StpipeValueError, match="got 'bogus'"):
        prefetch([1], "bogus")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_cuda_request_degrades_to_cpu_without_cuda():
    with pytest.warns(RuntimeWarning, match="CUDA is not available") as rec:
        p = prefetch([torch.ones(1)], "cuda")
    assert rec[0].filename == __file__  # points at the caller
    assert p.device == torch.device("cpu")
    assert [b.item() for b in p] == [1.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert prefetch([1], None).device == torch.device("cpu")


def test_close_from_another_thread_ends_iteration():
    def slow() -> Iterator[int]:
        yield 0
        time.sleep(0.5)
        yield 1

    p = prefetch(slow(), "cpu")
    assert next(p) == 0
    closer = threading.Timer(0.1, p.close)
    closer.start()
    with pytest.raises(StopIteration):
        next(p)
    closer.join()


def test_loader_that_waits_on_the_consumer_does_not_deadlock():
    """A batch is queued before the loader is asked for the next one (lockstep loaders)."""
    seen = threading.Event()

    def lockstep() -> Iterator[int]:
        yield 0
        if not seen.wait(timeout=5):
            raise TimeoutError("the consumer never got batch 0")
        yield 1

    p = prefetch(lockstep(), "cpu")
    assert next(p) == 0
    seen.set()
    assert list(p) == [1]


def test_repr_and_types():
    p = prefetch([1], "cpu", depth=3)
    assert isinstance(p, Prefetcher) and p.depth == 3 and "not started" in repr(p)
    assert iter(p) is p
    list(p)
    assert "closed" in repr(p)

"""GPU tests of :mod:`stpipe.loader`: values on device, stream safety, no leaks.

Run on a CUDA machine: ``python -m pytest tests/test_loader_gpu.py -q``. Every test
is marked ``gpu`` and skips cleanly without CUDA.
"""
from __future__ import annotations

import dataclasses
import gc
import threading
import time
from typing import Iterator, List, NamedTuple

import pytest
import torch

from stpipe._errors import StpipeRuntimeError
from stpipe.loader import prefetch

pytestmark = pytest.mark.gpu

_DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def _prefetch_threads() -> List[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("stpipe-prefetch-") and t.is_alive()]


@pytest.fixture(autouse=True)
def no_thread_leak():
    yield
    if _prefetch_threads():
        gc.collect()
    deadline = time.monotonic() + 2.0
    while _prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _prefetch_threads() == []


def _source(i: int, n: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    t = (torch.arange(n) + i).to(dtype)
    return t.pin_memory() if pinned else t


class Pair(NamedTuple):
    x: torch.Tensor
    tag: str


@dataclasses.dataclass
class Sample:
    ids: torch.Tensor
    meta: dict


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_values_arrive_on_device(cuda_device, dtype, pinned):
    sources = [_source(i, 4096, dtype, pinned) for i in range(6)]
    out = list(prefetch(sources, cuda_device))
    assert len(out) == 6
    for got, want in zip(out, sources):
        assert got.device == cuda_device and got.dtype == dtype
        assert torch.equal(got.cpu(), want)


def test_nested_batch_on_device(cuda_device):
    def batches() -> Iterator[dict]:
        for i in range(4):
            yield {
                "pair": Pair(torch.full((3,), i), tag=f"t{i}"),
                "sample": Sample(torch.tensor([i, i]).pin_memory(), {"w": 0.5, "y": [torch.ones(2) * i]}),
                "tuple": (torch.zeros(1), None, "s"),
            }

    for i, b in enumerate(prefetch(batches(), cuda_device)):
        assert isinstance(b["pair"], Pair) and b["pair"].tag == f"t{i}"
        assert b["pair"].x.device == cuda_device and b["pair"].x.tolist() == [i, i, i]
        assert isinstance(b["sample"], Sample) and b["sample"].meta["w"] == 0.5
        assert b["sample"].ids.device == cuda_device
        assert b["sample"].meta["y"][0].device == cuda_device
        assert b["tuple"][1:] == (None, "s")


def test_tensor_on_device_passes_through_and_alias_kept(cuda_device):
    on_dev = torch.ones(3, device=cuda_device)
    host = torch.arange(3).pin_memory()
    (b,) = list(prefetch([(on_dev, host, host)], cuda_device))
    assert b[0] is on_dev
    assert b[1] is b[2] and b[1].device == cuda_device


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("on_side_stream", [False, True], ids=["default_stream", "side_stream"])
def test_long_running_consumer_sees_correct_data(cuda_device, pinned, on_side_stream):
    """The consumer's stream is far behind: freed batches and modified sources must not leak in.

    Each batch is read only after ~10 ms of GPU sleep on the consumer's stream, its
    Python reference is dropped at once (only record_stream keeps its memory from the
    next copies) and its host source is overwritten right after hand-out.
    """
    n = 1 << 20
    steps = 8
    sources = [_source(i, n, torch.float32, pinned) for i in range(steps)]
    expected = [float(sum(range(i, i + n))) for i in range(steps)]
    stream = torch.cuda.Stream(cuda_device) if on_side_stream else torch.cuda.current_stream(cuda_device)
    sums = []
    with torch.cuda.stream(stream):
        for i, b in enumerate(prefetch(sources, cuda_device, depth=2)):
            torch.cuda._sleep(20_000_000)
            sums.append(b.double().sum())
            sources[i].fill_(-1.0)
            del b
    torch.cuda.synchronize(cuda_device)
    assert [s.item() for s in sums] == expected


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_dataloader_with_pin_memory(cuda_device):
    ds = torch.utils.data.TensorDataset(torch.arange(100).float(), torch.arange(100))
    loader = torch.utils.data.DataLoader(ds, batch_size=16, pin_memory=True, num_workers=2)
    p = prefetch(loader, cuda_device, depth=3)
    assert len(p) == 7
    got = torch.cat([y for _, y in p])
    assert got.device == cuda_device and got.tolist() == list(range(100))


def test_copy_stream_is_not_the_consumer_stream(cuda_device):
    p = prefetch([torch.zeros(1)], cuda_device)
    next(p)
    assert p._state.copy_stream != torch.cuda.current_stream(cuda_device)
    p.close()


def test_early_close_frees_device_memory(cuda_device):
    torch.cuda.synchronize(cuda_device)
    before = torch.cuda.memory_allocated(cuda_device)

    def big() -> Iterator[torch.Tensor]:
        while True:
            yield torch.ones(1 << 22).pin_memory()  # 16 MiB each

    p = prefetch(big(), cuda_device, depth=3)
    for i, b in enumerate(p):
        if i == 2:
            break
    del b
    thread = p.thread
    p.close()
    assert not thread.is_alive()
    torch.cuda.synchronize(cuda_device)
    assert torch.cuda.memory_allocated(cuda_device) == before


def test_loader_exception_on_gpu(cuda_device):
    def failing() -> Iterator[torch.Tensor]:
        yield torch.ones(2)
        yield torch.ones(2)
        raise RuntimeError("disk on fire")

    got = 0
    with pytest.raises(StpipeRuntimeError, match="batch 2") as info:
        for b in prefetch(failing(), cuda_device):
            assert b.device == cuda_device
            got += 1
    assert got == 2 and "disk on fire" in str(info.value.__cause__)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_explicit_second_device():
    dev = torch.device("cuda", 1)
    (b,) = list(prefetch([torch.ones(3)], dev))
    assert b.device == dev

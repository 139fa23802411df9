"""Test configuration: owns the strict ``gpu`` and ``slow`` markers.

``gpu`` tests skip cleanly where CUDA is unavailable. ``slow`` tests run unless
``--skip-slow`` is given.
"""
from __future__ import annotations

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--skip-slow", action="store_true", default=False, help="skip tests marked slow")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    skip_slow = pytest.mark.skip(reason="--skip-slow given")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and config.getoption("--skip-slow"):
            item.add_marker(skip_slow)


@pytest.fixture
def cuda_device():
    """The CUDA device for ``gpu`` tests."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda", torch.cuda.current_device())

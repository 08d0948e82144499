"""Fixtures shared by the model tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Run each test on one intra-op thread, restoring the setting afterwards.

    The tiny models here gain nothing from threads, while on a shared, oversubscribed
    machine OpenMP barriers make every small GEMM wait for a descheduled peer thread
    (measured: 100x slower forwards at load average 5 on 2 cores).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

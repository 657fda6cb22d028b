"""Fixtures the test modules share (their plain helpers are in helpers.py)."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny problems on one thread: an OpenMP region on two oversubscribed cores (other
    test processes running) costs milliseconds per op, for no gain at these sizes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

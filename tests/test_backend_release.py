"""``fsdp_int8._dist.released_by_backend``: a collective's caller leaves only once nothing
else holds the tensors it handed over (tests/distributed/test_ddp_exit.py checks it on
gloo's worker thread). Here another owner is an autograd graph, whose saved tensor adds a
C++ reference the way a backend's pending work does."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch

from fsdp_int8 import _dist


@pytest.fixture(autouse=True)
def _waits_enabled(monkeypatch):
    monkeypatch.setattr(_dist, "_release_waits", True)


def _held_elsewhere(tensor: torch.Tensor) -> torch.Tensor:
    """A graph saving ``tensor``: one C++ reference more until the graph is dropped."""
    return torch.ones(tensor.shape, requires_grad=True) * tensor


def test_waits_until_the_other_owner_lets_go():
    tensor = torch.ones(4)
    before = tensor._use_count()
    holder = [None]
    release_after_s = 0.05

    def release_later():
        time.sleep(release_after_s)
        holder[0] = None

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a timely release warns of nothing
        began = time.monotonic()
        with _dist.released_by_backend(tensor):
            holder[0] = _held_elsewhere(tensor)  # as a collective's work holds its tensors
            assert tensor._use_count() == before + 1
            thread = threading.Thread(target=release_later)
            thread.start()
        waited = time.monotonic() - began
    thread.join()
    assert tensor._use_count() == before
    assert waited >= 0.8 * release_after_s  # it waited for the release, not just returned


def test_a_release_that_never_comes_stops_the_waits_with_a_warning(monkeypatch):
    monkeypatch.setattr(_dist, "_RELEASE_TIMEOUT_S", 0.02)
    tensor = torch.ones(4)
    with pytest.warns(UserWarning, match="stops waiting for such releases"):
        with _dist.released_by_backend(tensor):
            kept = _held_elsewhere(tensor)
    assert not _dist._release_waits
    began = time.monotonic()
    with _dist.released_by_backend(tensor):  # no second wait, no second warning
        kept_too = _held_elsewhere(tensor)
    assert time.monotonic() - began < 0.02
    del kept, kept_too


def test_tensors_off_the_cpu_are_not_watched():  # meta stands in for an accelerator here
    tensor = torch.empty(4, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with _dist.released_by_backend(tensor):
            kept = torch.empty(4, device="meta", requires_grad=True) * tensor
    del kept

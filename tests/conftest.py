"""Shared setup for the single-process tests."""

from __future__ import annotations

import os
import sys

import pytest
import torch

# Let plain `pytest` (not only `python -m pytest` from the repo root) import the package.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from fsdp_int8._quant.generators import WEIGHT_ROUNDING  # noqa: E402

# Under pytest-xdist every worker is its own process: one intra-op thread each keeps
# `-n <cores>` from oversubscribing the CPU (the tests use small tensors anyway).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


_HERE = os.path.dirname(os.path.abspath(__file__))

# Tests marked `exhaustive` run only in the exhaustive matrix; the default run, CI's,
# deselects them (they are variants of cases the default run covers).
from _matrix import FULL_MATRIX  # noqa: E402  (tests/ is on sys.path: this file's folder)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "exhaustive: a variant run only in the exhaustive matrix (FSDP_INT8_FULL_MATRIX=1)"
    )


def pytest_collection_modifyitems(config, items):
    if FULL_MATRIX:
        return
    variants = [item for item in items if item.get_closest_marker("exhaustive")]
    if variants:
        config.hook.pytest_deselected(items=variants)
        items[:] = [item for item in items if not item.get_closest_marker("exhaustive")]


@pytest.fixture(autouse=True, scope="session")
def _scratch_working_directory(tmp_path_factory):
    """Tests run in an empty working directory of their own, not in the checkout.

    A test that writes a relative path (the launcher's default ``--out runs/demo``) leaves
    nothing behind, and a test cannot depend on what a README demo run left in the checkout
    (a checkpoint in ``runs/demo`` once changed a launcher test's error). Tests name
    repository files by absolute path; spawned ranks inherit this directory.
    """
    previous = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(previous)


@pytest.fixture(autouse=True)
def _deterministic_rngs(request):
    """Every single-process test starts from the same torch and stochastic-rounding streams.

    The stochastic-rounding generator is process-global, so without this a test's draws
    would depend on which tests xdist happened to run before it in the same worker.
    (Tests in subdirectories such as tests/distributed manage their own seeding.)
    """
    if os.path.dirname(str(request.node.path)) == _HERE:
        torch.manual_seed(0)
        WEIGHT_ROUNDING.manual_seed(0, 0)
    yield


@pytest.fixture
def accelerate_state():
    """accelerate's state is process-wide: leave it (and the environment) as found."""
    from accelerate.state import AcceleratorState, GradientState

    environ = dict(os.environ)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    os.environ.clear()
    os.environ.update(environ)

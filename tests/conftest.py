"""Shared fixtures: the paper chain and model, and one compiled default flow per session."""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

if "PYTEST_XDIST_WORKER" in os.environ:
    # the suite runs in parallel workers (pyproject's addopts): one thread each, so they do not contend for the cores
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(variable, "1")

# predictions are cached per user; the tests keep theirs apart, in a folder of this session
os.environ["FLOWSIM_PREDICTION_CACHE"] = tempfile.mkdtemp(prefix="flowsim-predictions-")
atexit.register(shutil.rmtree, os.environ["FLOWSIM_PREDICTION_CACHE"], ignore_errors=True)

# the harness that puts predictions beside the exact flow (benchmarks/prediction_accuracy.py) serves the tests too
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import flowsim
from flowsim.model.flow import GradientFlow

PAPER_PI = [0.75, 0.19, 0.05, 0.01]


@pytest.fixture(scope="session")
def paper_chain():
    return flowsim.MarkovChain(pi=PAPER_PI, lam=0.5)


@pytest.fixture(scope="session")
def paper_model():
    return flowsim.OneLayerTransformer(d=4, m=8, k=8)


@pytest.fixture(scope="session")
def default_flow(paper_chain, paper_model):
    """The default flow (ε = 1e-3, seed 0) and its initial point."""
    params0 = paper_model.init(1e-3, 0)
    return GradientFlow(flowsim.make_loss_function(paper_model, paper_chain), params0), params0


def random_chain(d, seed):
    """A dense random transition matrix (every entry > 0): irreducible and aperiodic."""
    P = np.random.default_rng(seed).random((d, d)) + 0.1
    return flowsim.MarkovChain(P=P / P.sum(axis=1, keepdims=True))


def random_params(model, scale, seed):
    return {name: scale * value for name, value in model.init(1.0, seed).items()}


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drop JAX's in-memory compilation caches after each test module: a full run otherwise holds the
    compiled code of every shape it met (the on-disk cache keeps recompiling cheap)."""
    yield
    import jax

    jax.clear_caches()


def interrupt_once(command: list[str], ready, signal_number: int) -> tuple[int, bytes]:
    """Start ``command`` (unbuffered), read its stderr until ``ready(stderr so far)``, send ``signal_number``, and
    return its exit status and the rest of its stderr (the whole of it)."""
    import subprocess

    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    progress = b""
    while not ready(progress):
        chunk = os.read(process.stderr.fileno(), 4096)
        assert chunk, f"{command[3:5]} ended before it was interrupted: {progress.decode(errors='replace')}"
        progress += chunk
    process.send_signal(signal_number)
    _, rest = process.communicate(timeout=60)
    return process.returncode, progress + rest

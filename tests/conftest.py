import os
import sys
import time
import uuid

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `import helpers` from any test module

import helpers


def pytest_report_header(config):
    import jax
    import jaxlib

    return f"jaxft tests: python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}"


@pytest.fixture(autouse=True)
def _run_deadline(request):
    """A command the test runs (helpers.run) times out ``helpers.STACKS_MARGIN_S`` before the
    test's own timeout (pytest-timeout's), so that a hang fails with the stacks of the
    command's processes and what they printed, not with the test runner's stack alone."""
    marker = request.node.get_closest_marker("timeout")
    ini = request.config.getini("timeout")
    limit = float(marker.args[0]) if marker is not None and marker.args else float(ini or 0)
    helpers.DEADLINE = time.monotonic() + limit - helpers.STACKS_MARGIN_S if limit > 0 else None
    yield
    helpers.DEADLINE = None


@pytest.fixture(scope="session", autouse=True)
def default_runs_dir(tmp_path_factory):
    """Where launches without ``--run-dir`` put their default run dirs for the whole session
    (``$JAXFT_RUNS_DIR``; helpers.clean_env keeps it): a temporary directory, not
    ``./jaxft-runs`` in the repository the tests run from. The session's runs also share one
    compilation cache (``$JAXFT_COMPILATION_CACHE``): a program one test compiled, the next
    loads (a test of a cold cache sets it empty: its run's own)."""
    path = tmp_path_factory.mktemp("jaxft-runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(helpers.RUNS_DIR_ENV, str(path))
        mp.setenv(helpers.CACHE_ENV, str(tmp_path_factory.mktemp("xla-cache")))
        yield path


@pytest.fixture(scope="session")
def one_process_exact(tmp_path_factory):
    """``steps -> params_sha256`` of ``mlp.py --reduction exact --exact_chunks 8`` run by one
    process, without a pipeline or batched commits: the bits a run with failures, at any
    width and with any of those options, must end with (each length run once a session)."""
    return helpers.one_process_shas(tmp_path_factory, *helpers.EXACT, "--commit_every", "1",
                                     absent=("started_early", "deferred"))


@pytest.fixture
def run_dir(tmp_path):
    """A fresh run directory for ``jaxft launch --run-dir`` (created by the launcher)."""
    return tmp_path / "run"


@pytest.fixture
def marker():
    """A unique string to put in a test's worker command lines.

    Finding it with pgrep tells which processes a test started. At teardown any process
    still carrying it is SIGKILLed by pid, and the test errors: it leaked processes.
    """
    tag = f"jaxft-test-{uuid.uuid4().hex[:12]}"
    yield tag
    leaked = helpers.kill_marked(tag)
    if leaked:
        pytest.fail(f"processes left running by the test (now killed): {leaked}")

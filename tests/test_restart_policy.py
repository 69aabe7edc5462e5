"""The launcher's restart decision (``jaxft.supervisor.restarts.RestartPolicy.decide``), in-process:
every branch, no processes."""

import signal

import pytest

from jaxft.errors import LaunchError
from jaxft.protocol import EXIT_BARRIER_TIMEOUT, EXIT_CONFIG_ERROR, EXIT_HUNG
from jaxft.supervisor.restarts import Action, Decision, Reason, RestartPolicy

pytestmark = pytest.mark.smoke

NEVER, ON_FAILURE, ALL = RestartPolicy("never"), RestartPolicy("on-failure"), RestartPolicy("all")
KILLED = -signal.SIGKILL


def decide(policy: RestartPolicy, code: int, restarts: int = 0, rounds: int = 0, crash_loop: bool = False):
    return policy.decide(code, restarts=restarts, rounds=rounds, crash_loop=crash_loop)


@pytest.mark.parametrize("policy", [NEVER, ON_FAILURE, ALL], ids=lambda p: p.mode)
def test_an_exit_0_is_never_restarted(policy):
    assert decide(policy, 0) == Decision(Action.STOP, Reason.FINISHED)


@pytest.mark.parametrize("policy", [NEVER, ON_FAILURE, ALL], ids=lambda p: p.mode)
def test_a_configuration_error_is_never_restarted(policy):
    assert decide(policy, EXIT_CONFIG_ERROR) == Decision(Action.STOP, Reason.CONFIG_ERROR)
    # not even when the crash-loop guard tripped too: the configuration error is what the user must see
    assert decide(policy, EXIT_CONFIG_ERROR, crash_loop=True) == Decision(Action.STOP, Reason.CONFIG_ERROR)


@pytest.mark.parametrize("code", [1, 3, KILLED, -signal.SIGSEGV, EXIT_BARRIER_TIMEOUT, EXIT_HUNG])
def test_never_restarts_no_failure(code):
    assert decide(NEVER, code) == Decision(Action.STOP, Reason.NEVER)
    assert decide(NEVER, code, crash_loop=True) == Decision(Action.STOP, Reason.NEVER)  # no guard without restarts


@pytest.mark.parametrize("code", [1, KILLED, EXIT_HUNG])
def test_on_failure_restarts_the_worker_within_its_budget(code):
    policy = RestartPolicy("on-failure", max_restarts=2)
    assert decide(policy, code, restarts=0) == Decision(Action.RESTART, Reason.FAILED)
    assert decide(policy, code, restarts=1, rounds=5) == Decision(Action.RESTART, Reason.FAILED)  # its own count
    assert decide(policy, code, restarts=2) == Decision(Action.STOP, Reason.BUDGET_SPENT)
    assert decide(RestartPolicy("on-failure", max_restarts=0), code) == Decision(Action.STOP, Reason.BUDGET_SPENT)


def test_all_restarts_every_worker_within_the_jobs_rounds():
    policy = RestartPolicy("all", max_restarts=2)
    assert decide(policy, 1, restarts=0, rounds=1) == Decision(Action.RESTART_ALL, Reason.FAILED)
    assert decide(policy, KILLED, restarts=0, rounds=2) == Decision(Action.STOP, Reason.BUDGET_SPENT)  # the job's count


def test_a_crash_loop_stops_the_worker_under_on_failure():
    assert decide(ON_FAILURE, 3, crash_loop=True) == Decision(Action.STOP, Reason.CRASH_LOOP)
    # the guard wins over a budget that has restarts left, and over one that is spent
    assert decide(ON_FAILURE, 3, restarts=10, crash_loop=True) == Decision(Action.STOP, Reason.CRASH_LOOP)


def test_a_crash_loop_ends_the_job_under_all():
    assert decide(ALL, 3, crash_loop=True) == Decision(Action.END_JOB, Reason.CRASH_LOOP)
    assert decide(ALL, 3, rounds=10, crash_loop=True) == Decision(Action.END_JOB, Reason.CRASH_LOOP)


def test_the_default_is_never_with_ten_restarts():
    p = RestartPolicy()
    assert (p.mode, p.max_restarts, p.delay_s, p.nice_restarts, p.hung_after_s) == ("never", 10, 0.0, 0, None)


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="sometimes"), "--restart must be one of"),
    (dict(delay_s=-1), "--restart-delay must be >= 0"),
    (dict(max_restarts=-1), "--max-restarts must be >= 0"),
    (dict(max_setup_crashes=-1), "--max-setup-crashes must be >= 0"),
])
def test_bad_settings_name_their_flag(kwargs, message):
    with pytest.raises(LaunchError, match=message):
        RestartPolicy(**kwargs).validate()
    RestartPolicy().validate()

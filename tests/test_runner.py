"""jaxft.worker.runner: a step program called in a worker thread that the main thread can leave."""

import threading
import time

import pytest

from jaxft.worker.runner import Abandoned, StepRunner


def test_results_and_errors_come_back_from_the_worker_thread():
    r = StepRunner()
    main = threading.current_thread()
    assert r.run(lambda: threading.current_thread() is not main)
    with pytest.raises(KeyError, match="boom"):
        r.run(lambda: {}["boom"])
    assert r.run(lambda: 7) == 7  # the same worker goes on after an error
    assert r.abandon("nothing in progress") is False


def test_an_abandoned_call_raises_and_the_next_call_runs_on_a_fresh_thread():
    r = StepRunner()
    release, started = threading.Event(), threading.Event()
    names = []

    def stuck():
        names.append(threading.current_thread().name)
        started.set()
        release.wait(10)
        return r.left()

    threading.Thread(target=lambda: (started.wait(10), r.abandon("a member died"))).start()
    with pytest.raises(Abandoned, match="a member died"):
        r.run(stuck)
    # the stuck job still runs; the next call does not queue behind it
    assert r.run(lambda: threading.current_thread().name) != names[0]
    assert r.drain(0.05) is False  # still running
    release.set()
    assert r.drain(5.0) is True
    assert r.abandoned_total == 1


def test_drain_is_bounded():
    r = StepRunner()
    threading.Timer(0.1, lambda: r.abandon("x")).start()
    with pytest.raises(Abandoned):
        r.run(lambda: time.sleep(3))
    assert r.drain(0.2) is False  # the left job sleeps on: drain gives up at its bound


def test_a_started_call_runs_while_the_caller_goes_on_and_hands_its_result_once():
    r = StepRunner()
    go = threading.Event()
    w = r.start(lambda: (go.wait(10), "step 5")[1])
    with pytest.raises(RuntimeError, match="already running"):
        r.start(lambda: None)  # one call at a time
    go.set()  # (the caller did its own work meanwhile)
    assert r.wait(w) == "step 5"
    assert r.run(lambda: 6) == 6  # waited for: the worker takes the next call
    w = r.start(lambda: {}["boom"])
    with pytest.raises(KeyError, match="boom"):
        r.wait(w)


def test_a_started_call_that_is_left_frees_the_runner_for_the_next():
    r = StepRunner()
    release = threading.Event()
    w = r.start(lambda: release.wait(10))
    assert r.abandon("the step before it failed") is True
    with pytest.raises(Abandoned, match="before it failed"):
        r.wait(w)
    assert r.run(lambda: 7) == 7  # a fresh worker
    release.set()
    assert r.drain(5.0) is True

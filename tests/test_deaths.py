"""The launcher's death records and the members' reading of them (no jax needed)."""

import threading
import time

from jaxft import deaths


def test_a_record_counts_only_against_a_life_seen_before_it(tmp_path):
    w = deaths.DeathWatch(str(tmp_path))
    assert w.dead([0, 1]) == set()
    w.saw({0: 11, 1: 21})
    deaths.record(str(tmp_path), 1, 0)
    assert w.dead([0, 1]) == {1}
    time.sleep(0.01)
    w.saw({1: 22})  # process 1's next life (a new service incarnation)
    assert w.dead([0, 1]) == set()
    # a life this process knows nothing of never counts (the heartbeat decides)
    assert deaths.DeathWatch(str(tmp_path)).dead([1]) == set()


def test_an_admitted_joiner_is_a_new_life(tmp_path):
    deaths.record(str(tmp_path), 2, 0)
    w = deaths.DeathWatch(str(tmp_path))
    w.assume_alive_since([0, 2], time.time())
    assert w.dead([0, 2]) == set()
    w.saw({0: 5, 2: 7})  # keeps the admission time, learns the incarnations
    assert w.dead([0, 2]) == set()
    time.sleep(0.01)
    deaths.record(str(tmp_path), 2, 1)
    assert w.dead([0, 2]) == {2}


def test_a_waiting_query_is_asked_again_without_the_dead(tmp_path):
    w = deaths.DeathWatch(str(tmp_path))
    w.saw({0: 1, 1: 1, 2: 1})
    asked, release = [], threading.Event()

    def query(pids):
        asked.append(list(pids))
        if 2 in pids:
            release.wait(10)  # like get_live_nodes waiting for a dead process
        return {p: 1 for p in pids if p != 2}

    threading.Timer(0.1, deaths.record, (str(tmp_path), 2, 0)).start()
    assert w.live_nodes(query, [0, 1, 2]) == {0: 1, 1: 1}
    assert asked == [[0, 1, 2], [0, 1]]
    release.set()


def test_without_a_state_dir_it_is_the_plain_query():
    w = deaths.DeathWatch(state_dir="")
    assert w.live_nodes(lambda pids: {p: 3 for p in pids}, [1, 0]) == {0: 3, 1: 3}

"""The launcher's death records and the members' reading of them (no jax needed)."""

import concurrent.futures
import threading
import time

import pytest

from jaxft import protocol
from jaxft.worker import asking, deaths, dirwatch
from jaxft.worker import lives as lives_lib


@pytest.fixture(params=["inotify", "polling"])
def wakeups(request, monkeypatch):
    """Each tripwire test runs on inotify (Linux) and on the polling fallback (elsewhere)."""
    if request.param == "polling":
        monkeypatch.setattr(dirwatch, "_inotify_fd", lambda path: None)
    return request.param


def test_a_record_counts_only_against_a_life_seen_before_it(tmp_path):
    w = deaths.DeathWatch(str(tmp_path))
    assert w.dead([0, 1]) == set()
    w.saw({0: 11, 1: 21})
    protocol.record_death(str(tmp_path), 1, 0)
    assert w.dead([0, 1]) == {1}
    time.sleep(0.01)
    w.saw({1: 22})  # process 1's next life (a new service incarnation)
    assert w.dead([0, 1]) == set()
    # a life this process knows nothing of never counts (the heartbeat decides)
    assert deaths.DeathWatch(str(tmp_path)).dead([1]) == set()


def test_an_admitted_joiner_is_a_new_life(tmp_path):
    protocol.record_death(str(tmp_path), 2, 0)
    w = deaths.DeathWatch(str(tmp_path))
    w.assume_alive_since([0, 2], time.time())
    assert w.dead([0, 2]) == set()
    w.saw({0: 5, 2: 7})  # keeps the admission time, learns the incarnations
    assert w.dead([0, 2]) == set()
    time.sleep(0.01)
    protocol.record_death(str(tmp_path), 2, 1)
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

    threading.Timer(0.1, protocol.record_death, (str(tmp_path), 2, 0)).start()
    assert w.live_nodes(query, [0, 1, 2]) == {0: 1, 1: 1}
    assert asked == [[0, 1, 2], [0, 1]]
    release.set()


def test_without_a_state_dir_it_is_the_plain_query():
    w = deaths.DeathWatch(state_dir="")
    assert w.live_nodes(lambda pids: {p: 3 for p in pids}, [1, 0]) == {0: 3, 1: 3}


class SetKeyedService:
    """The coordination service's rule for ``get_live_nodes`` (GetAliveTasksAsync): a query
    is matched to the pending one over the same process set, and answers everyone in it once
    every process the service counts alive has asked."""

    def __init__(self, alive):
        self.alive = set(alive)
        self.pending = []  # [(set, asked, event, answer box)]
        self.lock = threading.Lock()

    def _refresh(self):
        for state in list(self.pending):
            tasks, asked, done, box = state
            if (tasks & self.alive) <= asked:
                box.append({p: 1 for p in tasks & self.alive})
                done.set()
                self.pending.remove(state)

    def query_by(self, me):
        def query(pids):
            with self.lock:
                state = next((s for s in self.pending if s[0] == set(pids)), None)
                if state is None:
                    state = (set(pids), set(), threading.Event(), [])
                    self.pending.append(state)
                state[1].add(me)
                self._refresh()
            assert state[2].wait(5), f"process {me}: query over {sorted(pids)} never answered"
            return state[3][0]
        return query

    def declare_dead(self, p):  # the heartbeat timeout
        with self.lock:
            self.alive.discard(p)
            self._refresh()


def test_members_stay_in_step_when_one_re_asks_and_another_is_answered(tmp_path):
    # Process 2 dies. Member 0 sees the launcher's record and re-asks over {0, 1}; member 1 has
    # no record to read, so the service answers its first query when the heartbeat expires.
    # Both then make their next query (the next step's) over {0, 1}. Without the confirmation
    # of a smaller answer, member 1's next query completed member 0's re-ask (one query out of
    # step) and member 0's next query then waited for ever.
    service = SetKeyedService({0, 1, 2})
    w0 = deaths.DeathWatch(str(tmp_path))
    w0.saw({0: 1, 1: 1, 2: 1})
    w1 = deaths.DeathWatch(str(tmp_path / "elsewhere"))  # another node: no records
    results = {0: [], 1: []}

    def member(me, watch):
        for _ in range(2):
            results[me].append(watch.live_nodes(service.query_by(me), [0, 1, 2] if not results[me] else [0, 1]))

    t1 = threading.Thread(target=member, args=(1, w1))
    t1.start()
    time.sleep(0.1)  # member 1 waits in the query over {0, 1, 2}
    protocol.record_death(str(tmp_path), 2, 0)
    t0 = threading.Thread(target=member, args=(0, w0))
    t0.start()
    time.sleep(0.2)  # member 0 asked {0, 1, 2}, read the record, re-asked over {0, 1}
    service.declare_dead(2)  # member 1's first query is answered: {0, 1}
    t0.join(10)
    t1.join(10)
    assert results == {0: [{0: 1, 1: 1}] * 2, 1: [{0: 1, 1: 1}] * 2}


def test_an_old_answer_naming_a_joiners_previous_life_is_not_reused(tmp_path):
    # Process 2 died; the members' abandoned query over {0, 1, 2} was answered {0, 1} (process
    # 1's first life). Later process 1 dies too, comes back, and is admitted over {0, 1, 2}:
    # that old answer names process 1 but not its new life. Reusing it put the member one
    # query out of step with the joiner (both waited for ever); it must ask afresh.
    w = deaths.DeathWatch(str(tmp_path))
    w.saw({0: 10, 1: 11, 2: 12})
    old = concurrent.futures.Future()
    old.set_result({0: 10, 1: 11})
    w._abandon((0, 1, 2), old)
    asked = []

    def query(pids):
        asked.append(list(pids))
        return {0: 10, 1: 21, 2: 22}

    assert w.live_nodes(query, [0, 1, 2], admitted={1: 21}) == {0: 10, 1: 21, 2: 22}
    assert asked == [[0, 1, 2]]
    # an answer naming a life of the joiner other than the admitted one (the life the
    # launcher's retirement registered, say): an older query's, asked afresh
    other = concurrent.futures.Future()
    other.set_result({0: 10, 1: 25, 2: 22})
    w._abandon((0, 1, 2), other)
    assert w.live_nodes(query, [0, 1, 2], admitted={1: 21}) == {0: 10, 1: 21, 2: 22} and len(asked) == 2
    # an answer with the joiner's admitted life in it is the query the joiner completed: reused
    fresh = concurrent.futures.Future()
    fresh.set_result({0: 10, 1: 31, 2: 22})
    w._abandon((0, 1, 2), fresh)
    assert w.live_nodes(query, [0, 1, 2], admitted={1: 31}) == {0: 10, 1: 31, 2: 22} and len(asked) == 2


def test_a_member_late_to_an_admission_takes_the_left_query_the_joiner_completed_before_it_admitted(tmp_path):
    # Issue 40's schedule, 2 runs of 5: members 0, 2, 3 left their exit query over {0, 1, 2, 3}
    # when 1 died (the service, with 1's retired life alive to it, kept it open). At the
    # admission of 1's restart, 2 admitted first and waited on that left query, and 1's first
    # ask completed it, 7 ms before 0 and 3 admitted. They took the answer for an old one
    # (answered before their own admission), asked afresh, and waited there for 1 and 2, who
    # had gone on to the rebuild's barrier: 60 s (Timeouts.reset), then a restart. The answer
    # names 1's admitted life: it is the members' entry, whenever it came.
    w = deaths.DeathWatch(str(tmp_path))
    w.saw({0: 10, 1: 11, 2: 12, 3: 13})
    left = concurrent.futures.Future()
    w._abandon((0, 1, 2, 3), left)
    left.set_result({0: 10, 1: 21, 2: 12, 3: 13})  # completed by the joiner, before this member admitted it

    def query(pids):
        raise AssertionError(f"asked afresh over {pids}: the others never ask that query again")

    assert w.live_nodes(query, [0, 1, 2, 3], admitted={1: 21}) == {0: 10, 1: 21, 2: 12, 3: 13}


def test_a_member_stops_waiting_for_a_process_that_registered_a_newer_life(tmp_path, monkeypatch):
    # Process 1 died where no launcher saw it (another node); the service declared it dead and
    # its restart connected: the service counts the new life in any query over process 1 from
    # then on, and it asks none until it is admitted. A member whose exit query expects 1's
    # old life reads the registered lives and asks again without 1, instead of waiting until
    # its barrier timeout.
    w = deaths.DeathWatch(str(tmp_path))
    w.LIVES_CHECK_S = 0.05
    registered = {0: lives_lib.Life(0, 10, "a", 0), 1: lives_lib.Life(1, 21, "b", 1), 2: lives_lib.Life(2, 12, "c", 0)}
    monkeypatch.setattr(deaths.lives_lib, "all_current", lambda client=None: registered)
    assert set(w.restarted([0, 1, 2], {0: 10, 1: 11, 2: 12})) == {1}
    assert w.restarted([0, 1, 2], {0: 10, 1: 21, 2: 12}) == {}  # (the life expected is the registered one)
    asked, release = [], threading.Event()

    def query(pids):
        asked.append(list(pids))
        if 1 in pids:  # answered only once the new life of 1 asks: never, here
            release.wait(10)
            raise TimeoutError("released")
        return {0: 10, 2: 12}

    try:
        assert w.live_nodes(query, [0, 1, 2], lives={0: 10, 1: 11, 2: 12}) == {0: 10, 2: 12}
        assert asked == [[0, 1, 2], [0, 2]]
        assert w.noticed == {1: "process 1 restarted (a new life registered; the one in this member map is over)"}
    finally:
        release.set()


def test_a_member_on_another_node_stops_waiting_for_a_life_its_launcher_retired(tmp_path, monkeypatch):
    # Process 1 died on another node: no death record here, but its launcher's helper wrote
    # the new incarnation it gave 1 in the service as 1's life record, marked retired
    # (jaxft.supervisor.retire.record_retired). A member waiting for 1's old life reads it and asks
    # again without 1, and says how it knew.
    w = deaths.DeathWatch(str(tmp_path))  # (this node's records: none)
    w.LIVES_CHECK_S = 0.05
    registered = {0: lives_lib.Life(0, 10, "a", 0), 1: lives_lib.Life(1, 99, "", 3, retired=True)}
    monkeypatch.setattr(deaths.lives_lib, "all_current", lambda client=None: registered)
    release = threading.Event()

    def query(pids):
        if 1 in pids:
            release.wait(10)
            raise TimeoutError("released")
        return {0: 10}

    try:
        assert w.live_nodes(query, [0, 1], lives={0: 10, 1: 11}) == {0: 10}
        assert w.noticed == {1: "process 1's launcher saw it exit (it retired that life in the service)"}
    finally:
        release.set()
    # the placeholder life itself is over too (it never heartbeats); a restart's record is not
    assert lives_lib.over(registered[1], 99) == "process 1's life was retired by its launcher"
    assert lives_lib.over(lives_lib.Life(1, 100, "n", 4), 100) is None


def test_a_tripwire_fires_once_per_arming_for_a_member_recorded_dead(tmp_path, wakeups):
    w = deaths.DeathWatch(str(tmp_path))
    w.saw({0: 1, 1: 1, 2: 1})
    fired: list[set[int]] = []
    hit = threading.Event()
    wire = deaths.Tripwire(w, lambda dead: (fired.append(dead), hit.set()), poll_s=0.005)
    wire.arm([1, 2])
    time.sleep(0.05)
    assert fired == []  # nobody died: the step's body runs undisturbed
    protocol.record_death(str(tmp_path), 0, 0)  # not one of the armed members
    time.sleep(0.05)
    assert fired == []
    protocol.record_death(str(tmp_path), 2, 0)
    assert hit.wait(2)
    time.sleep(0.05)
    assert fired == [{2}]  # once, although the record stays
    wire.disarm()
    wire.arm([1])  # the next step's members: 2's death is not theirs
    time.sleep(0.05)
    assert fired == [{2}]
    wire.disarm()


def test_a_disarmed_tripwire_never_fires(tmp_path, wakeups):
    w = deaths.DeathWatch(str(tmp_path))
    w.saw({1: 1})
    fired = []
    wire = deaths.Tripwire(w, fired.append, poll_s=0.005)
    wire.arm([1])
    wire.disarm()  # the step's body ended
    protocol.record_death(str(tmp_path), 1, 0)
    time.sleep(0.1)
    assert fired == []


def test_a_record_that_lands_between_steps_fires_at_the_next_arming(tmp_path, wakeups, monkeypatch):
    monkeypatch.setattr(deaths.Tripwire, "SAFETY_S", 60.0)  # only the arming itself can look in time
    w = deaths.DeathWatch(str(tmp_path))
    w.saw({1: 1, 2: 1})
    hit = threading.Event()
    fired: list[set[int]] = []
    wire = deaths.Tripwire(w, lambda dead: (fired.append(dead), hit.set()), poll_s=0.005)
    for _ in range(3):  # steps over the same members: the last check found nobody
        wire.arm([1, 2])
        time.sleep(0.02)
        wire.disarm()
    protocol.record_death(str(tmp_path), 2, 0)  # between two steps
    time.sleep(0.05)
    assert fired == []
    wire.arm([1, 2])  # the same members as the last check: the record must still be seen
    assert hit.wait(10)
    assert fired == [{2}]
    wire.disarm()
    hit.clear()
    wire.arm([1, 2])  # the record stays, and each arming fires once
    assert hit.wait(10) and fired == [{2}, {2}]
    wire.disarm()


def test_on_inotify_an_armed_tripwire_reads_nothing_until_a_record_lands(tmp_path, monkeypatch):
    monkeypatch.setattr(deaths.Tripwire, "SAFETY_S", 60.0)
    w = deaths.DeathWatch(str(tmp_path))
    if not deaths.Tripwire(w, lambda dead: None)._dir.native:
        pytest.skip("no inotify here (the tripwire polls)")
    w.saw({1: 1, 2: 1})
    reads = []
    dead = w.dead
    w.dead = lambda pids, fresh=False: (reads.append(time.monotonic()), dead(pids, fresh))[1]
    hit = threading.Event()
    wire = deaths.Tripwire(w, lambda gone: hit.set())
    wire.arm([1, 2])  # the first arming looks
    deadline = time.monotonic() + 10
    while not reads and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    wire.disarm()
    first = len(reads)
    assert first >= 1
    for _ in range(50):  # then 50 steps of ~2 ms over the same members
        wire.arm([1, 2])
        time.sleep(0.002)
        wire.disarm()
    wire.arm([1, 2])
    time.sleep(0.05)
    assert len(reads) == first, reads  # none of them looked (the polling loop read every 10 ms)
    protocol.record_death(str(tmp_path), 1, 0)
    assert hit.wait(10), "the record did not wake the tripwire"  # (SAFETY_S is a minute here)
    wire.disarm()


def test_a_dir_watch_wakes_on_a_replaced_entry_on_wake_and_on_its_timeout(tmp_path):
    d = dirwatch.DirWatch(str(tmp_path / "deaths"))  # (made if missing)
    t0 = time.monotonic()
    assert d.wait(0.05) is False and time.monotonic() - t0 >= 0.04
    d.wake()
    t0 = time.monotonic()
    assert d.wait(30) is False and time.monotonic() - t0 < 10
    if not d.native:
        pytest.skip("no inotify here: only wake() and the timeout end a wait")
    protocol.record_death(str(tmp_path), 3, 0)  # written aside, then os.replace'd in
    t0 = time.monotonic()
    assert d.wait(30) is True and time.monotonic() - t0 < 10
    assert d.wait(0.01) is False  # drained: one landing, one wake-up


def test_a_canceller_sets_the_wait_s_event_and_names_the_dead(tmp_path, wakeups):
    w = deaths.DeathWatch(str(tmp_path))
    w.saw({1: 1, 2: 1})
    protocol.record_death(str(tmp_path), 2, 0)  # dead before the wait begins: the event is set at its start
    c = deaths.Canceller(w)
    event = threading.Event()
    with c.during(event, [1, 2]):
        assert event.wait(10)
    assert event.dead == {2}
    quiet = threading.Event()
    with c.during(quiet, [1]):  # 2's death is not this wait's
        time.sleep(0.05)
    assert not quiet.is_set()


def test_records_written_in_a_burst_are_all_seen(tmp_path):
    w = deaths.DeathWatch(str(tmp_path))
    w.saw({p: 1 for p in range(4)})
    assert w.dead(range(4)) == set()
    for p in range(4):  # the reader caches by the directory's stamp: each record must show
        protocol.record_death(str(tmp_path), p, 0)
        assert w.dead(range(4)) == set(range(p + 1))


def test_a_query_thread_is_reused_once_its_query_returned_and_never_while_one_hangs():
    names = []

    def who():
        names.append(threading.current_thread())  # (an ident may be reused after a thread ends)
        return {0: 1}

    # (the thread files itself as idle before it hands over the answer: no race here)
    assert asking.ask(lambda pids: who(), [0]).result(timeout=5) == {0: 1}
    assert asking.ask(lambda pids: who(), [0]).result(timeout=5) == {0: 1}
    assert names[0] is names[1], "the second query ran on a new thread"

    # a query that never returns (abandoned) keeps its thread; the next one gets another
    release = threading.Event()
    hung = asking.ask(lambda pids: release.wait(30), [0, 1])
    time.sleep(0.05)
    assert not hung.done()
    assert asking.ask(lambda pids: who(), [0]).result(timeout=5) == {0: 1}
    release.set()
    assert hung.result(timeout=5) is True

    # an error reaches the waiter, and the thread stays usable
    def boom(pids):
        raise RuntimeError("service gone")

    with pytest.raises(RuntimeError, match="service gone"):
        asking.ask(boom, [0]).result(timeout=5)
    assert asking.ask(lambda pids: sorted(pids), [2, 1]).result(timeout=5) == [1, 2]
    assert len(asking.QueryThread._idle) <= asking.QueryThread.IDLE_MAX


def test_a_restart_may_connect_once_every_witness_dropped_its_dead_life(tmp_path, monkeypatch):
    state = str(tmp_path)
    monkeypatch.setenv(protocol.FAULT_STATE_DIR, state)
    w = deaths.DeathWatch(state)
    w.saw({0: 1, 1: 1, 2: 1})
    monkeypatch.setenv(protocol.PROCESS_ID, "0")
    protocol.mark_dropped(2)  # a mark of an earlier life of 2: older than the death below
    time.sleep(0.01)
    died_at = time.time()
    protocol.record_death(state, 2, 0)
    assert not protocol.restart_may_connect(state, 2, died_at, [0, 1])
    # member 0's exit answer no longer names 2's life: live_nodes marks it
    assert w.live_nodes(lambda pids: {p: 1 for p in pids if p != 2}, [0, 1, 2], lives={0: 1, 1: 1, 2: 1}) \
        == {0: 1, 1: 1}
    assert not protocol.restart_may_connect(state, 2, died_at, [0, 1]), "member 1 may still be in a query with 2"
    # an answer that names every life marks nothing
    monkeypatch.setenv(protocol.PROCESS_ID, "1")
    w.live_nodes(lambda pids: {p: 1 for p in pids}, [0, 1], lives={0: 1, 1: 1})
    assert not protocol.restart_may_connect(state, 2, died_at, [0, 1])
    protocol.record_death(state, 1, 0)  # a witness that died since counts as one that dropped it
    assert protocol.restart_may_connect(state, 2, died_at, [0, 1])
    assert not protocol.restart_may_connect(state, 2, time.time() + 1, [0, 1]), "only marks after the death count"


def test_a_query_that_raises_timeouterror_is_not_taken_for_a_poll_that_timed_out(tmp_path):
    # concurrent.futures.TimeoutError is the built-in TimeoutError: a query raising it used to be
    # re-raised by future.result() in the poll loop for ever, its traceback growing (the test
    # suite's own process grew ~50 MB/s while a service-model test's stuck member spun so)
    w = deaths.DeathWatch(str(tmp_path), poll_s=0.002)
    w.saw({0: 1, 1: 1})

    def query(pids):
        time.sleep(0.05)
        raise TimeoutError("the service never answered")

    with pytest.raises(TimeoutError, match="never answered"):
        w.live_nodes(query, [0, 1])


def test_a_cold_start_process_left_in_its_first_query_reads_the_others_records():
    from jaxft.core import coldstart as cs

    cold = [0, 1, 2, 3]
    confirm = cs.Record(writer=0, pids=(0, 2, 3), time=2.0)
    # the others confirm a set that names it: it asks that set (only from the cold start's query)
    assert cs.stranded(3, 7, cold, cold, [], [confirm]) == cs.Switch((0, 2, 3))
    assert cs.stranded(3, 7, (0, 2, 3), cold, [], [confirm]) is None
    assert cs.stranded(1, 7, cold, cold, [], [confirm]) is None  # (not named: it waits, or joins later)
    # a members record naming this life: the others entered a step with it
    entered = cs.Record(writer=0, pids=(0, 2, 3), time=3.0, lives={0: 5, 2: 6, 3: 7})
    assert cs.stranded(3, 7, cold, cold, [entered], [confirm]) == cs.Adopt({0: 5, 2: 6, 3: 7})
    assert cs.stranded(3, 8, cold, cold, [entered], [confirm]) is None  # (an earlier life of it: not this one)
    # one without it: they started without it, it joins as a restart does
    assert cs.stranded(1, 9, cold, cold, [entered], []) == cs.Joined()
    older = cs.Record(writer=2, pids=(0, 1, 2, 3), time=1.0, lives={0: 5, 1: 9, 2: 6, 3: 4})
    assert cs.stranded(1, 9, cold, cold, [older, entered], []) == cs.Joined()  # (the newest record counts)
    assert cs.adoptable(3, None, entered) is None and cs.adoptable(3, 7, None) is None
    # in the switched query (its set is no longer the cold start's), the members records still count
    assert cs.stranded(3, 7, (0, 2, 3), cold, [entered], [confirm]) == cs.Adopt({0: 5, 2: 6, 3: 7})


def test_a_member_left_in_a_later_entry_query_takes_the_entry_the_others_entered_with():
    from jaxft.core import coldstart as cs

    entered = cs.Record(writer=0, pids=(0, 2, 3), time=3.0, lives={0: 5, 2: 6, 3: 7})
    expected = {0: 5, 3: 7}  # (the members' lives it knows; a joiner's may be -1: not read)
    last = {1: 4, 2: 6, 3: 7}  # the entry it last entered with
    # the others entered the step over the set it asks, with this life: it enters with them
    assert cs.entered_with(2, 6, [0, 2, 3], expected, last, [entered]) == cs.Adopt({0: 5, 2: 6, 3: 7})
    assert cs.entered_with(2, 6, [0, 2, 3], {0: -1, 3: 7}, last, [entered]) == cs.Adopt({0: 5, 2: 6, 3: 7})
    # not with an earlier life of it, nor over another set, nor with no record (or no life known)
    assert cs.entered_with(2, 4, [0, 2, 3], expected, last, [entered]) is None
    assert cs.entered_with(2, 6, [0, 1, 2, 3], expected, last, [entered]) is None
    assert cs.entered_with(2, 6, [0, 2, 3], expected, last, []) is None
    assert cs.entered_with(2, None, [0, 2, 3], expected, last, [entered]) is None
    # not with lives other than those it expects (a record of another step: 0's earlier life)
    assert cs.entered_with(2, 6, [0, 2, 3], {0: 8, 3: 7}, last, [entered]) is None
    # not the entry it last entered with: the record may be that step's
    assert cs.entered_with(2, 6, [0, 2, 3], expected, {0: 5, 2: 6, 3: 7}, [entered]) is None
    # the newest record decides: the others moved on over another set since
    later = cs.Record(writer=3, pids=(2, 3), time=4.0, lives={2: 6, 3: 7})
    assert cs.entered_with(2, 6, [0, 2, 3], expected, last, [entered, later]) is None
    assert cs.entered_with(2, 6, [2, 3], {3: 7}, last, [entered, later]) == cs.Adopt({2: 6, 3: 7})


def test_a_query_left_on_adopting_the_others_entry_is_the_next_ask_over_its_set(tmp_path):
    from jaxft.core import liveness

    # the rule: an answered left query is taken only for its joiners' lives, or when left on adopting
    assert liveness.reuse_left_query(False, None, {})
    assert not liveness.reuse_left_query(True, {0: 1, 2: 3}, {})
    assert liveness.reuse_left_query(True, {0: 1, 2: 3}, {}, adopted=True)
    assert liveness.reuse_left_query(True, {0: 1, 2: 3}, {2: 3})
    assert not liveness.reuse_left_query(True, {0: 1, 2: 4}, {2: 3})

    def run(adopt: bool) -> tuple[dict, int]:
        release, calls = threading.Event(), []

        def query(pids):  # the service: the first ask is answered once the others ask (release)
            calls.append(list(pids))
            if len(calls) == 1:
                release.wait(10)
                return {0: 1, 1: 2, 2: 3}  # (their exit answer, completing the left query)
            return {0: 9, 1: 9, 2: 9}  # an ask anew: a later query's answer

        w = deaths.DeathWatch(str(tmp_path), poll_s=0.002)
        with pytest.raises(deaths.GaveUp):
            w.live_nodes(query, [0, 1, 2], give_up=lambda: True)  # (the watch gave up: it adopts)
        if adopt:
            w.adopted({0: 1, 1: 2, 2: 3})
        release.set()  # the others' next ask over {0, 1, 2} completes the query it left
        time.sleep(0.05)
        return w.live_nodes(query, [0, 1, 2]), len(calls)

    assert run(adopt=True) == ({0: 1, 1: 2, 2: 3}, 1)  # its exit answer is theirs
    assert run(adopt=False) == ({0: 9, 1: 9, 2: 9}, 2)  # (without: asked anew, one query out of step)

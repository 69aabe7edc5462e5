"""When a member set's CPU data plane is rebuilt and when its backend is kept (jaxft.core.plane).

The runs behind it: ``test_spares.py`` (a spare kept the backend, a restart rebuilt it) and
``test_admission.py`` (a restart into a list stepped on with its previous life rebuilds)."""

import json

from jaxft.core import plane

OLD = {0: 0, 1: 0, 2: 0}  # lives of the first member set (0, 1, 2)


def member(used=None, suspect=(), synced=OLD):
    """One member's state: its used lists (with lives), its suspect lists, its synced map."""
    return dict(used=dict(used or {(0, 1, 2): OLD}), suspect=set(suspect), synced=synced)


def answers(members, current):
    """Every member's answer, through JSON as the service carries it."""
    return [json.loads(json.dumps(plane.answer(m["used"], m["suspect"], current, m["synced"]))) for m in members]


def test_a_cold_start_rebuilds():
    current = {0: 0, 1: 0}
    fresh = dict(used={}, suspect=set(), synced=None)
    assert plane.own_need({}, (), current, None) == plane.FRESH
    assert plane.rebuild_agreed([a["need"] for a in answers([fresh, fresh], current)])


def test_a_spare_swapped_into_a_list_nobody_stepped_on_keeps_the_backend():
    # process 1 died in a step over (0, 1, 2): the list is suspect; spare 3 takes its place
    old = member(suspect={(0, 1, 2)})
    spare = dict(used={}, suspect=set(), synced=None)
    current = {0: 0, 2: 0, 3: 0}
    got = answers([old, old, spare], current)
    assert [a["need"] for a in got] == [plane.KEEPS, plane.KEEPS, plane.FRESH]
    assert not plane.rebuild_agreed([a["need"] for a in got])


def test_a_restart_into_a_list_its_previous_life_stepped_on_rebuilds():
    old = member()  # (0, 1, 2) used with process 1's life 0, and not suspect: its death came between steps
    restart = dict(used={}, suspect=set(), synced=None)
    current = {0: 0, 1: 1, 2: 0}
    assert plane.own_need(old["used"], old["suspect"], current, OLD) == plane.NEEDS
    assert plane.rebuild_agreed([a["need"] for a in answers([old, restart, old], current)])


def test_a_suspect_list_rebuilds_and_the_same_lives_on_a_clean_one_keep():
    assert plane.own_need({(0, 1): {0: 0, 1: 0}}, {(0, 1)}, {0: 0, 1: 0}, {0: 0, 1: 0}) == plane.NEEDS
    assert plane.own_need({(0, 1): {0: 0, 1: 0}}, (), {0: 0, 1: 0}, {0: 0, 1: 0}) == plane.KEEPS


def test_a_joiner_that_kept_the_backend_decides_later_as_the_members_do():
    # The members stepped on (0, 3) with process 3's earlier life; 3's new life comes back as a
    # spare into (0, 2, 3), a list nobody stepped on, and the backend is kept. Later (0, 3) is
    # the survivors' list: the members' communicator for it is stale. Without the members'
    # history the joiner would answer "keep" and wait at the list's rendezvous while the
    # members wait at the sync's barrier.
    used = {(0, 2): {0: 0, 2: 0}, (0, 3): {0: 0, 3: 0}}
    old = member(used=used, synced={0: 0, 2: 0})
    joiner_synced = {0: 0, 2: 0, 3: 1}
    swap = {0: 0, 2: 0, 3: 1}
    got = answers([old, old, dict(used={}, suspect=set(), synced=None)], swap)
    assert not plane.rebuild_agreed([a["need"] for a in got])
    adopted_used, adopted_suspect = plane.history(got)
    later = {0: 0, 3: 1}
    for u, s in ((old["used"], old["suspect"]), (adopted_used, adopted_suspect)):
        assert plane.own_need(u, s, later, joiner_synced) == plane.NEEDS
    assert plane.own_need({}, set(), later, joiner_synced) == plane.KEEPS  # (what it answered before)

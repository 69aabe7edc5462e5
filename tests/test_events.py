"""The shared events.jsonl: many real processes appending at once."""

import json
import subprocess
import time

import numpy as np
import pytest
from helpers import PYTHON, clean_env

from jaxft.events import EVENTS_FILE, EventLog, read_events

REQUIRED = ("time", "event", "process", "incarnation")

WRITER = """
import os, sys, time
from jaxft.events import EventLog
run_dir, go, process, count, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
log = EventLog(run_dir, process, incarnation=process % 2)
while not os.path.exists(go):
    time.sleep(0.002)
for seq in range(count):
    # Lines larger than PIPE_BUF (4 KiB): whole-line writes must not rely on pipe atomicity.
    log.log("tick", seq=seq, payload=chr(65 + process) * (size + (seq * 37) % 500))
"""


@pytest.mark.smoke
def test_concurrent_appends_give_whole_lines(tmp_path):
    run_dir = tmp_path / "run"
    go = tmp_path / "go"
    writers, count, size = 4, 400, 5000
    procs = [subprocess.Popen([PYTHON, "-c", WRITER, str(run_dir), str(go), str(p), str(count), str(size)],
                              env=clean_env(), stderr=subprocess.PIPE, text=True)
             for p in range(writers)]
    try:
        time.sleep(1.0)  # let every writer import and wait at the start line
        go.touch()
        for p in procs:
            _, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    raw = (run_dir / EVENTS_FILE).read_bytes()
    assert raw.endswith(b"\n")
    lines = raw.split(b"\n")[:-1]
    assert len(lines) == writers * count
    seqs: dict[int, list[int]] = {p: [] for p in range(writers)}
    for i, line in enumerate(lines):
        record = json.loads(line)  # a torn or interleaved line fails here
        for key in REQUIRED:
            assert key in record, f"line {i} lacks {key!r}"
        assert record["event"] == "tick"
        assert isinstance(record["time"], float)
        p = record["process"]
        assert record["incarnation"] == p % 2
        assert set(record["payload"]) == {chr(65 + p)}
        assert len(record["payload"]) == size + (record["seq"] * 37) % 500
        seqs[p].append(record["seq"])
    # Each writer's own lines are complete and in its order.
    for p in range(writers):
        assert seqs[p] == list(range(count)), f"writer {p}"
    assert len(read_events(run_dir)) == writers * count


def test_log_record_and_json_conversion(tmp_path):
    log = EventLog(tmp_path / "r", process=3, incarnation=2)
    record = log.log("step", value=np.float32(1.5), arr=np.arange(3), ids={2, 1}, pair=(1, "a"),
                     obj=object)
    assert record["event"] == "step" and record["process"] == 3 and record["incarnation"] == 2
    [back] = read_events(tmp_path / "r")
    assert back["value"] == 1.5
    assert back["arr"] == [0, 1, 2]
    assert back["ids"] == [1, 2]
    assert back["pair"] == [1, "a"]
    assert isinstance(back["obj"], str)
    # The launcher logs on behalf of a worker: explicit fields override the defaults.
    launcher = EventLog(tmp_path / "r", "launcher")
    launcher.log("exit", process=1, incarnation=4)
    assert read_events(tmp_path / "r")[-1]["process"] == 1
    assert read_events(tmp_path / "r")[-1]["incarnation"] == 4


def test_no_run_dir_is_a_no_op(tmp_path):
    log = EventLog(None, 0)
    assert log.path is None
    assert log.log("anything", x=1)["event"] == "anything"
    assert read_events(tmp_path) == []  # no events.jsonl at all


def test_read_events_skips_a_torn_last_line(tmp_path):
    log = EventLog(tmp_path, 0)
    log.log("a")
    log.log("b")
    with open(tmp_path / EVENTS_FILE, "a") as f:
        f.write('{"time": 1.0, "event": "torn", "proc')  # the writer was SIGKILLed mid-line
    assert [e["event"] for e in read_events(tmp_path)] == ["a", "b"]

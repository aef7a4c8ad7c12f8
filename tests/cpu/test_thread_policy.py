"""The CPU thread policy (issue 32): the intra-op pool never collapses beside a busy process.

``choose_threads`` is pure; ``other_busy_cores`` is checked against a real busy process started here, and
``apply_thread_policy`` against ``OMP_NUM_THREADS``; ``ThreadGovernor`` on a fake clock and /proc/stat, and
once on the real one beside a busy process. The speed side (1 vs 2 threads, spinning vs passive
waiting, beside a busy process) is a benchmark, ``python -m roofline.bench.cpu``, not a timed test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from roofline.cpu import (
    ThreadGovernor,
    _proc_stat_times,
    apply_thread_policy,
    choose_threads,
    free_cores,
    other_busy_cores,
    wait_policy_is_passive,
)


def test_choose_threads():
    assert choose_threads(2, 0.0) == (2, "2 usable cores, 0.0 busy with other processes")
    assert choose_threads(2, 1.0)[0] == 1  # spinning threads: one core left free, one thread
    assert choose_threads(2, 3.7)[0] == 1  # never fewer than one
    assert choose_threads(8, 2.4)[0] == 6
    assert choose_threads(2, 1.0, passive=True) == (2, "2 usable cores, OpenMP wait policy passive")
    assert choose_threads(2, None) == (2, "2 usable cores, load unknown")
    assert choose_threads(2, 1.0, requested=3) == (3, "OMP_NUM_THREADS=3; more than the 2 usable cores: "
                                                      "oversubscribed, slower")
    assert choose_threads(2, 1.0, requested=2) == (2, "OMP_NUM_THREADS=2")
    with pytest.raises(ValueError, match="cores must be >= 1, got 0"):
        choose_threads(0, 0.0)
    with pytest.raises(ValueError, match="OMP_NUM_THREADS must be >= 1, got 0"):
        choose_threads(2, 0.0, requested=0)


def test_proc_stat_parsing(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 5 20 800 10 1 2 3 0 0\ncpu0 50 2 10 400 5 0 1 1 0 0\ncpu1 50 3 10 400 5 1 1 2 0 0\n"
                    "intr 12345\n")
    assert _proc_stat_times(str(stat)) == (131, 941, 2)  # busy = all but idle (800) and iowait (10)
    assert _proc_stat_times(str(tmp_path / "missing")) is None


@pytest.mark.skipif(_proc_stat_times() is None, reason="no /proc/stat")
def test_a_busy_process_is_seen():
    busy = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    try:
        seen = other_busy_cores(0.3)
    finally:
        busy.kill()
        busy.wait()
    assert seen is not None and seen >= 0.7  # one spinning process is (about) one core


def test_omp_num_threads_wins(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        line, governor = apply_thread_policy("float32")
        assert torch.get_num_threads() == 1 and governor is None  # a pinned count is never re-sized
        assert line.startswith("CPU: ") and "dtype float32" in line and line.endswith(", 1 thread (OMP_NUM_THREADS=1)")
        monkeypatch.setenv("OMP_NUM_THREADS", "two")
        with pytest.raises(ValueError, match="OMP_NUM_THREADS must be an integer >= 1, got 'two'"):
            apply_thread_policy("float32")
        monkeypatch.setenv("OMP_NUM_THREADS", "")
        with pytest.raises(ValueError, match="OMP_NUM_THREADS must be an integer >= 1, got ''"):
            apply_thread_policy("float32")
    finally:
        torch.set_num_threads(before)


def test_proc_stat_affinity_subset(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 5 20 800 10 1 2 3 0 0\ncpu0 50 2 10 400 5 0 1 1 0 0\ncpu1 50 3 10 400 5 1 1 2 0 0\n")
    assert _proc_stat_times(str(stat), cpus=frozenset({1})) == (67, 472, 1)  # cpu1 only: 472 - 400 - 5 busy
    assert _proc_stat_times(str(stat), cpus=frozenset({7})) is None  # no such CPU listed


def test_free_cores():
    assert [free_cores(2, b) for b in (0.0, 0.4, 0.6, 1.0, 5.0)] == [2, 2, 1, 1, 1]
    assert free_cores(8, 2.4) == 6


class _FakeMachine:
    """A clock, this process's CPU time and /proc/stat jiffies (100 per core-second over 2 CPUs), advanced by
    ``run(seconds, own_cores, other_cores)``."""

    def __init__(self):
        self.t = self.own = 0.0
        self.busy = self.total = 0

    def run(self, seconds, own_cores, other_cores):
        self.t += seconds
        self.own += own_cores * seconds
        self.busy += round(100 * seconds * (own_cores + other_cores))
        self.total += round(100 * seconds * 2)

    def governor(self, threads=2, **kw):
        self.calls = []
        return ThreadGovernor(2, threads, read_stat=lambda: (self.busy, self.total, 2), clock=lambda: self.t,
                              cpu_time=lambda: self.own, set_threads=self.calls.append, **kw)


def test_governor_shrinks_at_once_and_grows_after_two_quiet_readings():
    m = _FakeMachine()
    g = m.governor(interval_s=0.5)
    m.run(0.3, own_cores=2.0, other_cores=0.0)
    assert g.tick() is None and m.calls == []  # no reading before interval_s
    m.run(0.3, own_cores=2.0, other_cores=0.0)
    assert g.tick() is None and m.calls == [] and abs(g.last_other_busy) < 0.02  # quiet: stays at 2
    m.run(0.6, own_cores=1.3, other_cores=0.7)  # another process took 0.7 of a core
    assert g.tick() == 1 and m.calls == [1] and g.threads == 1
    assert abs(g.last_other_busy - 0.7) < 0.02
    m.run(0.6, own_cores=1.0, other_cores=1.0)
    assert g.tick() is None  # still busy: stays at 1
    m.run(0.6, own_cores=1.0, other_cores=0.0)
    assert g.tick() is None and m.calls == [1]  # first quiet reading: a vote, no change
    m.run(0.6, own_cores=1.0, other_cores=0.0)
    assert g.tick() == 2 and m.calls == [1, 2] and g.changes == 2
    m.run(0.6, own_cores=2.0, other_cores=0.0)
    assert g.tick() is None  # quiet at 2 threads
    assert g.seconds_at == pytest.approx({2: 1.8, 1: 1.8})
    assert g.summary() == ("2 for 1.8 s, 1 for 1.8 s since start-up (re-sized 2 times to the cores other processes "
                           "left free)")


def test_governor_a_busy_reading_resets_the_grow_votes():
    m = _FakeMachine()
    g = m.governor(threads=1, interval_s=0.5)
    for other in (0.0, 1.0, 0.0):  # quiet, busy, quiet: never two quiet readings in a row
        m.run(0.6, own_cores=1.0, other_cores=other)
        assert g.tick() is None
    m.run(0.6, own_cores=1.0, other_cores=0.0)
    assert g.tick() == 2


def test_governor_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"threads must be in \[1, cores=2\], got 3"):
        ThreadGovernor(2, 3, read_stat=lambda: None, set_threads=print)
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        ThreadGovernor(2, 2, interval_s=0, read_stat=lambda: None, set_threads=print)


@pytest.mark.skipif(_proc_stat_times() is None or len(os.sched_getaffinity(0)) < 2, reason="needs /proc/stat, 2 cores")
def test_governor_sees_a_real_busy_process():
    calls = []
    g = ThreadGovernor(2, 2, interval_s=0.2, set_threads=calls.append)
    busy = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    try:
        time.sleep(0.5)  # this process sleeps: the busy one is about a whole core of "others"
        assert g.tick() == 1 and calls == [1], g.last_other_busy
    finally:
        busy.kill()
        busy.wait()


def test_wait_policy_is_passive_needs_no_spin(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    assert wait_policy_is_passive()  # the suite's setting (conftest)
    monkeypatch.setenv("GOMP_SPINCOUNT", "100000")
    assert not wait_policy_is_passive()  # roofline's default: a bounded spin

"""The CPU thread policy (issue 32): the intra-op pool never collapses beside a busy process.

``choose_threads`` is pure; ``other_busy_cores`` is checked against a real busy process started here, and
``apply_thread_policy`` against ``OMP_NUM_THREADS``. The speed side (1 vs 2 threads, spinning vs passive
waiting, beside a busy process) is a benchmark, ``python -m roofline.bench.cpu``, not a timed test.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from roofline.cpu import _proc_stat_times, apply_thread_policy, choose_threads, other_busy_cores


def test_choose_threads():
    assert choose_threads(2, 0.0) == (2, "2 usable cores, 0.0 busy with other processes at start-up")
    assert choose_threads(2, 1.0)[0] == 1  # spinning threads: one core left free, one thread
    assert choose_threads(2, 3.7)[0] == 1  # never fewer than one
    assert choose_threads(8, 2.4)[0] == 6
    assert choose_threads(2, 1.0, passive=True) == (2, "2 usable cores, OpenMP wait policy passive")
    assert choose_threads(2, None) == (2, "2 usable cores, load unknown")
    assert choose_threads(2, 1.0, requested=3) == (3, "OMP_NUM_THREADS=3")
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
        line = apply_thread_policy("float32")
        assert torch.get_num_threads() == 1
        assert line.startswith("CPU: ") and "dtype float32" in line and line.endswith(", 1 thread (OMP_NUM_THREADS=1)")
        monkeypatch.setenv("OMP_NUM_THREADS", "two")
        with pytest.raises(ValueError, match="OMP_NUM_THREADS must be an integer >= 1, got 'two'"):
            apply_thread_policy("float32")
    finally:
        torch.set_num_threads(before)

"""``roofline generate`` end to end in a subprocess, on the real default model.

Few cases: every process that gets past argument checks loads the model.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def roofline(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "roofline.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_generate_prints_output_and_summary():
    r = roofline("generate", "--prompt", "The capital of France is", "--max-tokens", "4", "--floor", "none",
                 "--no-progress")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "prompt (5 tokens): 'The capital of France is'" in out
    assert re.search(r"output \[0\] \(4 tokens, finish_reason=length\): ' Paris\.", out)
    assert re.search(r"^requests:\s+1$", out, re.M)
    assert re.search(r"^prompt tokens:\s+5$", out, re.M)
    assert re.search(r"^generated tokens:\s+4$", out, re.M)
    m = re.search(r"^output throughput:\s+([0-9.]+) tok/s$", out, re.M)
    assert m and float(m.group(1)) > 0
    assert re.search(r"^preemptions:\s+0$", out, re.M)
    # The KV pool at start-up: 2 GiB of fp32 KV at 46,080 bytes/token (2 x 30 layers x 3 KV heads x 64 x 4 B) on CPU.
    m = re.search(r"^KV cache: (\d+) tokens \((\d+) blocks of 16, float32, 46080 bytes/token, ([0-9.]+) GiB\); "
                  r"per-step token budget (\d+)$", out, re.M)
    assert m and int(m.group(1)) == 16 * int(m.group(2)) == 16 * ((2 << 30) // (46080 * 16))
    assert 64 <= int(m.group(4)) <= 2048 and int(m.group(4)) % 16 == 0
    # The CPU start-up line: what the machine offers, and the thread count with its reason (roofline.cpu).
    # The format note (exact, or the faster dtype this CPU has) sits in parentheses after the dtype.
    assert re.search(r"^CPU: .+ \(\d+ cores; .+\); dtype float32 \(exact[^)]*\), \d+ threads? \(.+\)$", out, re.M)
    assert "bandwidth:" not in out  # --floor none: no probe
    assert "Processed prompts" not in r.stderr  # --no-progress


def test_bad_sampling_flag_exits_2():
    r = roofline("generate", "--prompt", "x", "--max-tokens", "0", "--floor", "none", "--no-progress")
    assert r.returncode == 2
    assert "max_tokens must be >= 1, got 0" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_engine_flag_exits_2_before_loading():
    r = roofline("generate", "--prompt", "x", "--block-size", "0", "--floor", "none", "--no-progress",
                 timeout=120)
    assert r.returncode == 2
    assert "block_size must be in [1, 1024], got 0" in r.stderr
    assert "Traceback" not in r.stderr


def test_unparsable_flag_exits_2():
    r = roofline("generate", "--max-tokens", "four", timeout=120)
    assert r.returncode == 2
    assert "--max-tokens" in r.stderr and "invalid int value: 'four'" in r.stderr

"""``roofline generate`` end to end in a subprocess, on the real default model.

Few cases: every process that gets past argument checks loads the model.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


# ---------------------------------------------------------------- checks before the model loads (in process)


def _generate_args(*argv: str):
    from roofline.cli import build_parser

    return build_parser().parse_args(["generate", "--floor", "none", "--no-progress", *argv])


@pytest.fixture
def no_model(monkeypatch):
    """Constructing the model fails the test: every check here must come first."""
    import roofline.llm

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the argument check")

    monkeypatch.setattr(roofline.llm, "LLM", refuse)


def _prompts_file_cases(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\n")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "a"}\nnot json\n')
    no_key = tmp_path / "nokey.jsonl"
    no_key.write_text('{"text": "a"}\n')
    bad_ids = tmp_path / "badids.jsonl"
    bad_ids.write_text('{"prompt_token_ids": [1, 2]}\n{"prompt_token_ids": [1, -2]}\n')
    return [
        ("/dev/null", ValueError, "--prompts-file '/dev/null' is not a regular file (a device, pipe or socket); "
                                  "give a text file with one prompt per line"),
        (str(tmp_path), ValueError, f"--prompts-file {str(tmp_path)!r} is not a regular file (a directory); give "
                                    f"a text file with one prompt per line"),
        (str(tmp_path / "missing.txt"), FileNotFoundError,
         f"--prompts-file {str(tmp_path / 'missing.txt')!r} does not exist"),
        (str(empty), ValueError, f"--prompts-file {str(empty)!r} is empty; give one prompt per line"),
        (str(blank), ValueError, f"--prompts-file {str(blank)!r} has no prompts (only blank lines)"),
        (str(bad_json), ValueError, f"--prompts-file {str(bad_json)!r} line 2 is not JSON (Expecting value)"),
        (str(no_key), ValueError, f"--prompts-file {str(no_key)!r} line 1 must be a JSON object with a string "
                                  "'prompt' key (or a 'prompt_token_ids' list), got '{\"text\": \"a\"}'"),
        (str(bad_ids), ValueError, f"--prompts-file {str(bad_ids)!r} line 2: 'prompt_token_ids' must be a non-empty "
                                   "list of integers >= 0, got [1, -2]"),
    ]


def test_prompts_file_problems_are_named_before_the_model_loads(tmp_path, no_model):
    from roofline.commands import run_generate

    for path, error, message in _prompts_file_cases(tmp_path):
        with pytest.raises(error) as e:
            run_generate(_generate_args("--prompts-file", path))
        assert str(e.value) == message


def test_unreadable_prompts_file(tmp_path, no_model, monkeypatch):
    import builtins

    from roofline.commands import run_generate

    f = tmp_path / "secret.txt"
    f.write_text("hi\n")
    f.chmod(0)
    if os.geteuid() == 0:  # root reads it anyway: refuse the read as the kernel would for another user
        real_open = builtins.open

        def no_permission(file, *args, **kwargs):
            if str(file) == str(f):
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", no_permission)
    with pytest.raises(ValueError) as e:
        run_generate(_generate_args("--prompts-file", str(f)))
    assert str(e.value) == f"--prompts-file {str(f)!r} cannot be read: Permission denied"


def test_prompts_file_lines_and_jsonl_are_read(tmp_path):
    from roofline.commands import _read_prompts

    text = tmp_path / "p.txt"
    text.write_text("first prompt\n\nsecond\n")
    assert _read_prompts(str(text)) == ["first prompt", "second"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a b"}\n\n{"prompt": "c", "id": 2}\n{"prompt_token_ids": [1, 5, 0]}\n')
    assert _read_prompts(str(jsonl)) == ["a b", "c", {"prompt_token_ids": [1, 5, 0]}]


def test_negative_show_is_refused_before_the_model_loads(no_model):
    from roofline.commands import run_generate

    with pytest.raises(ValueError) as e:
        run_generate(_generate_args("--prompt", "x", "--show", "-1"))
    assert str(e.value) == "--show must be >= 0 (outputs to print), got -1"


def test_dev_null_prompts_file_exits_2_without_a_traceback():
    r = roofline("generate", "--prompts-file", "/dev/null", "--floor", "none", "--no-progress", timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == ("roofline: error: --prompts-file '/dev/null' is not a regular file (a device, pipe or "
                                "socket); give a text file with one prompt per line")
    assert r.stdout == ""  # nothing loaded: no KV cache line


def test_non_utf8_prompt_is_refused_before_the_model_loads(no_model):
    from roofline.commands import run_generate

    with pytest.raises(ValueError) as e:
        run_generate(_generate_args("--prompt", "Hello", "--prompt", "hi \udcff\udcfe there"))
    assert str(e.value) == ("--prompt 2 contains a lone UTF-16 surrogate '\\udcff' at character 3 (non-UTF-8 "
                            "bytes?): not valid Unicode text")


def test_serve_port_out_of_range_or_taken_is_refused_before_the_model_loads(monkeypatch, capsys):
    import socket

    import roofline.server.app
    from roofline.cli import main

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the port check")

    monkeypatch.setattr(roofline.server.app, "build_app", refuse)

    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", "99999"])
    assert e.value.code == 2
    assert "argument --port: must be in [0, 65535], got 99999" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 3
    assert f"roofline serve: error: cannot serve on 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err

"""What every GPU/CPU benchmark records beside its figures: device, versions, commit, date; and one writer."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def git_sha() -> str:
    """HEAD's commit, with ``-dirty`` appended where tracked files differ from it (``ROOFLINE_GIT_SHA`` overrides
    it where the tree has no .git of its own). A device copy carries the working tree with git metadata that can
    lag it: on 2026-12-05 results of later code were named for 569a11f, so such a run now reads ``569a11f…-dirty``
    unless the caller passes the real commit."""
    sha = os.environ.get("ROOFLINE_GIT_SHA")
    if sha:
        return sha
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, check=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - no git on the machine: record it as unknown
        return "unknown"
    return f"{head}-dirty" if changed else head


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "git_commit": git_sha(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "num_cpu_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device=torch.cuda.get_device_name(0), num_sms=props.multi_processor_count,
                   device_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    else:
        env["device"] = "cpu"
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def write_result(out_dir: str | Path, name: str, payload: dict[str, Any]) -> Path:
    """Write ``<out_dir>/<name>-<date>-<sha8>.json`` with the environment merged in; returns the path."""
    env = environment()
    result = {"benchmark": name, **env, **payload}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = env["date"][:10].replace("-", "")
    sha = env["git_commit"]
    path = out / f"{name}-{stamp}-{sha[:8]}{'-dirty' if sha.endswith('-dirty') else ''}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    return path


def parse_sizes(text: str) -> list[int]:
    """``"1,8,32k"`` -> [1, 8, 32768]."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1
        try:
            value = float(part.rstrip("k")) * mult
        except ValueError as e:
            raise ValueError(f"sizes must be comma-separated positive integers (a k suffix means x1024), "
                             f"got {part!r}") from e
        if value <= 0:
            raise ValueError(f"sizes must be positive, got {part!r}")
        out.append(int(value))
    return out

"""The engine core (scheduler, block manager, sequences, step messages, detokenizer, LLMEngine) is plain
Python: importing it must not import torch (DESIGN: only the worker makes device tensors). Each import runs
in a fresh interpreter, since this test process has torch loaded already."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHECK = (
    "import importlib, sys; importlib.import_module({module!r}); "
    "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
    "print('TORCH' if bad else 'CLEAN', bad[:3])"
)


def _imports_torch(module: str) -> tuple[bool, str]:
    proc = subprocess.run([sys.executable, "-c", _CHECK.format(module=module)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip()
    assert out.startswith(("TORCH", "CLEAN")), out
    return out.startswith("TORCH"), out


@pytest.mark.parametrize("module", [
    "roofline.engine.scheduler",
    "roofline.engine.block_pool",
    "roofline.engine.radix_cache",
    "roofline.engine.sequence",
    "roofline.step",
    "roofline.engine.detokenizer",
    "roofline.engine.llm_engine",
    "roofline.engine.stats",
    "roofline.engine.output_processor",
    "roofline.engine.worker_view",
    "roofline.spec_decode.proposer",
    "roofline.spec_decode.controller",
])
def test_engine_module_does_not_import_torch(module):
    imports, out = _imports_torch(module)
    assert not imports, f"importing {module} loaded {out}"


def test_the_check_detects_torch():
    """The probe itself: a module that does pull torch in is reported."""
    imports, out = _imports_torch("roofline.layers.linear")
    assert imports, out

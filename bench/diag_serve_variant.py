"""Diagnostic only: `roofline serve` with the speculative engine drafting only in steps with no prefill work
pending (no waiting request, no running prefill chunk). Usage as `python -m roofline.cli`."""
import sys

import roofline.engine.llm_engine as E
from roofline.cli import main

_orig = E.LLMEngine._drafting_due


def _due(self):
    sch = self.scheduler
    if sch.waiting or any(s.is_prefill for s in sch.running):
        return False
    return _orig(self)


E.LLMEngine._drafting_due = _due
sys.exit(main(sys.argv[1:]))

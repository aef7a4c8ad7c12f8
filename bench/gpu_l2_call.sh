#!/usr/bin/env bash
# Device steps for the L2 weight prefetch (issue 28): GPU tests, the probe (bulk vs per-line prefetch, a GEMV cold,
# prefetched and hot), the batch-1 int4 step's timeline with the per-line prefetch of o_proj, and bench decode
# A/B in one process. $OUT gets the logs. Run from the repo root.
set -u; export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/log
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_l2_prefetch.py 2>&1 | tail -3 | tee -a $OUT/log
timeout 60 python3 bench/gpu_l2_prefetch.py --out $OUT/probe.json 2>&1 | tail -6 | tee -a $OUT/log
timeout 100 python3 -c "
import sys; sys.argv=['x','--model','llama-3-8b','--quantization','int4','--batch','1','--steps','4','--top','12']
from roofline.kernels import l2_prefetch; l2_prefetch.MAX_BYTES=64<<20; l2_prefetch.SITES=frozenset({'o_proj'})
import runpy; runpy.run_path('bench/gpu_decode_profile.py', run_name='__main__')
" > $OUT/prof_line.log 2>&1; grep -A14 "^timeline" $OUT/prof_line.log | tee -a $OUT/log
timeout 300 python3 -m roofline.cli bench decode --model llama-3-8b --batch-sizes 1 --contexts 1k --quantization ${QUANTS:-int4,none} --l2-prefetch ${L2S:-0,o_proj:64line,o_proj+gate_up_proj+down_proj:24line} --out-dir $OUT/decode > $OUT/decode.log 2>&1; echo rc $? | tee -a $OUT/log
grep -E "measured|^ +[0-9]|x$|rror" $OUT/decode.log | tail -30 | tee -a $OUT/log

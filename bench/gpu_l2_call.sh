set -u; export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/log
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_l2_prefetch.py tests/kernels/test_act_quant_fused.py tests/kernels/test_quant_gemm.py 2>&1 | tail -15 | tee -a $OUT/log
timeout 60 python3 bench/gpu_l2_prefetch.py --out $OUT/probe.json 2>&1 | tail -8 | tee -a $OUT/log
timeout 420 python3 -m roofline.cli bench decode --model llama-3-8b --batch-sizes 1 --contexts 1k --quantization none,int4 --l2-prefetch 0,o_proj:64,o_proj+gate_up_proj@qkv:24,o_proj+gate_up_proj+down_proj:24 --out-dir $OUT/decode > $OUT/decode.log 2>&1; echo rc $? | tee -a $OUT/log
grep -E "measured|^ +[0-9]|x$|rror" $OUT/decode.log | tail -30 | tee -a $OUT/log

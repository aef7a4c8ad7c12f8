#!/usr/bin/env bash
# H200 A/B, each tree from its own directory: llama-3-8b bf16 main vs qkv-through-our-GEMV; qwen3 main vs integ.
set -uo pipefail
export PYTHONUNBUFFERED=1
O=$OUT; T0=$SECONDS; R=$(pwd)
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader | tee -a $O/log
name=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))")
if [ "$name" != NVIDIA_H200 ]; then  # apply the H200 tables on this card too (noted in the log)
  for t in base qkv integ; do for d in dispatch_tables moe_configs; do
    f=$R/.ab/$t/roofline/kernels/$d/NVIDIA_H200.json; [ -f $f ] && cp $f $R/.ab/$t/roofline/kernels/$d/$name.json
  done; done; echo "H200 tables copied to $name" | tee -a $O/log
fi
dec() { # TREE TAG MODEL
  (cd $1 && PYTHONPATH=$1 timeout 60 python3 -m roofline.cli bench decode --model $3 --batch-sizes 1 --contexts 512 \
     --steps 16 --out-dir $O/ab-$2 > $O/ab.log 2>&1; echo "rc $?") > $O/rc.txt
  echo "$3 $2 $(cat $O/rc.txt) at $((SECONDS-T0))s: $(grep -E '^ +1 +512' $O/ab.log | tail -1)" | tee -a $O/log
}
for rep in 1 2; do
  dec $R/.ab/base base llama-3-8b; dec $R/.ab/qkv qkv llama-3-8b
  dec $R/.ab/base base qwen3-30b-a3b; dec $R/.ab/integ integ qwen3-30b-a3b
done
echo "done at $((SECONDS-T0))s" | tee -a $O/log

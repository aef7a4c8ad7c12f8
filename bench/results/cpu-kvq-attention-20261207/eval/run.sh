# quantized KV quality on the new CPU path (every row a C++ kernel item) and the old one (SDPA), same settings
for t in /work/main /tmp/old; do
  cd $t
  /usr/bin/time -f "%e s" env PYTHONPATH=$t /work/main/.venv/bin/python -m roofline.cli eval --device cpu --dtype float32 \
    --max-num-batched-tokens 512 --num-eval-tokens 8192 --passkey-lengths 1024 --greedy-prompts 8 \
    --candidates kv_cache_dtype=int8 kv_cache_dtype=fp8_e4m3 --output-json /tmp/evalq/$(basename $t).json \
    > /tmp/evalq/$(basename $t).log 2>&1
  echo "$t rc $?" >> /tmp/evalq/done
done

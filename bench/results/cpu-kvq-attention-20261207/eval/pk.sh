for t in /work/main /tmp/old; do
  cd $t
  env PYTHONPATH=$t /work/main/.venv/bin/python -m roofline.cli eval --device cpu --dtype float32 \
    --max-num-batched-tokens 512 --num-eval-tokens 1024 --passkey-lengths 1024 --greedy-prompts 0 \
    --passkey-depths 0,0.05,0.1,0.15,0.2,0.25,0.3,0.35,0.4,0.45,0.5,0.55,0.6,0.65,0.7,0.75,0.8,0.85,0.9,0.95,1 \
    --candidates kv_cache_dtype=int8 kv_cache_dtype=fp8_e4m3 --output-json /tmp/evalq/pk-$(basename $t).json \
    > /tmp/evalq/pk-$(basename $t).log 2>&1
  echo "$t rc $?" >> /tmp/evalq/pkdone
done

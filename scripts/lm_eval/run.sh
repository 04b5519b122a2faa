#!/usr/bin/env bash
# Score SmolLM2-135M-Instruct's trained agents with lm-evaluation-harness (`lm_eval`, a real
# OpenAI-API client) against `python -m forkjax.serve`, under one cache policy.
#
#   scripts/lm_eval/run.sh POLICY [LM_EVAL_VENV] [OUT_DIR]
#
#   POLICY        prefix | full_reuse | forkkv | forkkv+fanout | lrshared
#                 (forkkv = --cache-policy forkkv --no-residual-fanout; forkkv+fanout, the
#                 server's default for forkkv = --cache-policy forkkv --residual-fanout)
#   LM_EVAL_VENV  a venv with lm_eval[api]==0.4.13 and transformers (default /tmp/lme); see
#                 scripts/lm_eval/README.md for how it was built (no torch needed)
#   OUT_DIR       default /tmp/forkjax-lm-eval/<POLICY>[-<ADAPTERS>]
#
# Environment:
#   MODELS    the served models lm_eval scores, in order (default "extractor critic"). All of
#             them run against ONE server, one after the other: the first (the writer) fills the
#             KV cache with the tasks' prompts, the next ones (readers) find those prompts cached.
#             Under `prefix` a reader only hits its own pages (exact); under full_reuse / forkkv
#             / lrshared it reads the writer's K/V, so its scores show what the policy costs.
#   ADAPTERS  trained (forkjax/models/adapters/smollm2-135m/*, the server's default) or shared-a
#             (the same roles trained on one frozen A: required by lrshared, and the exact
#             reference for it under prefix). Default: shared-a for lrshared, trained otherwise.
#   PORT      server port (default: a free one)
#   TASKS     default "forkjax_mc forkjax_gen" (scripts/lm_eval/tasks)
#   SERVER_ARGS  extra flags for forkjax.serve
#
# Writes OUT_DIR/server.log, OUT_DIR/lm_eval_<model>.log, OUT_DIR/lm_eval/<model>/results_*.json
# and samples_*.jsonl (per-request log-likelihoods and generations), OUT_DIR/metrics_<n>_<model>.txt
# (the server's /metrics after each model: cache hits) and OUT_DIR/timings.tsv.
set -euo pipefail

POLICY=${1:?usage: run.sh POLICY [LM_EVAL_VENV] [OUT_DIR]}
LME=${2:-/tmp/lme}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PY="$ROOT/.venv/bin/python"                       # the project's venv runs the server
MODELS=${MODELS:-extractor critic}
TASKS=${TASKS:-forkjax_mc forkjax_gen}
ADAPTER_ROOT="$ROOT/forkjax/models/adapters/smollm2-135m"

case "$POLICY" in
  prefix|full_reuse|lrshared) CACHE_ARGS=(--cache-policy "$POLICY") ;;
  forkkv) CACHE_ARGS=(--cache-policy forkkv --no-residual-fanout) ;;
  forkkv+fanout) CACHE_ARGS=(--cache-policy forkkv --residual-fanout) ;;
  *) echo "run.sh: unknown policy $POLICY" >&2; exit 2 ;;
esac
if [[ $POLICY == lrshared ]]; then ADAPTERS=${ADAPTERS:-shared-a}; else ADAPTERS=${ADAPTERS:-trained}; fi
LORA_ARGS=()
if [[ $ADAPTERS == shared-a ]]; then
  # Replace the default agents by the shared-A set (same names), which lrshared accepts.
  for role in caller critic extractor; do LORA_ARGS+=(--lora "$role=$ADAPTER_ROOT/shared-a/$role"); done
  TAG="$POLICY-shared-a"
elif [[ $ADAPTERS == trained ]]; then
  TAG="$POLICY"                                     # --model smollm2-135m loads them itself
else
  echo "run.sh: ADAPTERS must be trained or shared-a, not $ADAPTERS" >&2; exit 2
fi
OUT=${3:-/tmp/forkjax-lm-eval/$TAG}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# No model hub: lm_eval's HF datasets / tokenizer code must never try the network.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# lm_eval needs a tokenizer to split context and continuation (log-likelihood tasks). Its
# `remote` backend asks the server for GET /tokenizer_info, which forkjax does not serve, so we
# hand it the server's own tokenizer (built from the GGUF file) as a local HF directory.
TOK=${TOKENIZER_DIR:-/tmp/forkjax-smollm2-tokenizer}
[[ -f $TOK/tokenizer.json ]] || "$PY" "$HERE/export_tokenizer.py" "$TOK"

PORT=${PORT:-$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
URL="http://127.0.0.1:$PORT"

now() { date +%s.%N; }
printf 'step\tseconds\n' > "$OUT/timings.tsv"
T0=$(now)

# The server: float32 (the CPU's fast path), --max-model-len 512 (the tasks' prompts are < 100
# tokens; the default 8192 makes every step's attention span 8192 positions on the CPU, ~20x
# slower), --warmup none (compile only the few shapes these requests need; the programs persist
# in ~/.cache/forkjax/jax, so later runs start warm).
"$PY" -m forkjax.serve --model smollm2-135m "${LORA_ARGS[@]}" "${CACHE_ARGS[@]}" \
  --dtype float32 --max-model-len 512 --warmup none --host 127.0.0.1 --port "$PORT" \
  ${SERVER_ARGS:-} > "$OUT/server.log" 2>&1 &
SERVER=$!
stop_server() {
  if kill -0 "$SERVER" 2>/dev/null; then
    kill -TERM "$SERVER"                            # graceful: drains, then exits 0
    wait "$SERVER" || true
  fi
}
trap stop_server EXIT

for _ in $(seq 1 300); do                           # wait for /health (weights load in ~10 s)
  curl -sf "$URL/health" > /dev/null && break
  kill -0 "$SERVER" 2>/dev/null || { echo "run.sh: server died, see $OUT/server.log" >&2; tail -20 "$OUT/server.log" >&2; exit 1; }
  sleep 1
done
curl -sf "$URL/health" > /dev/null || { echo "run.sh: server not healthy after 300 s" >&2; exit 1; }
T1=$(now); printf 'server_start\t%.1f\n' "$(echo "$T1 - $T0" | bc)" >> "$OUT/timings.tsv"
echo "server up at $URL (policy $POLICY, adapters $ADAPTERS), log $OUT/server.log"

n=0
for MODEL in $MODELS; do
  n=$((n + 1))
  TS=$(now)
  # local-completions: log-likelihood requests are /v1/completions with echo=true, logprobs=1,
  # max_tokens=1, temperature=0, seed; generations with max_tokens, stop, temperature=0, seed.
  # tokenized_requests=False: prompts go as text (the server tokenizes them the same way).
  # Run from $OUT so that nothing lm_eval writes relative to the cwd lands in the repo.
  (cd "$OUT" && "$LME/bin/lm_eval" run --model local-completions \
      --model_args "model=$MODEL,base_url=$URL/v1/completions,num_concurrent=1,max_retries=1,tokenized_requests=False,tokenizer_backend=huggingface,tokenizer=$TOK,max_length=512" \
      --tasks $TASKS --include_path "$HERE/tasks" \
      --output_path "$OUT/lm_eval" --log_samples) > "$OUT/lm_eval_$MODEL.log" 2>&1 \
    || { echo "run.sh: lm_eval failed for $MODEL, see $OUT/lm_eval_$MODEL.log and $OUT/server.log" >&2; exit 1; }
  TE=$(now); printf 'lm_eval_%s\t%.1f\n' "$MODEL" "$(echo "$TE - $TS" | bc)" >> "$OUT/timings.tsv"
  curl -sf "$URL/metrics" > "$OUT/metrics_${n}_$MODEL.txt" || true
  grep -A4 '^|' "$OUT/lm_eval_$MODEL.log" | sed "s/^/[$MODEL] /"
done

stop_server
T2=$(now); printf 'total\t%.1f\n' "$(echo "$T2 - $T0" | bc)" >> "$OUT/timings.tsv"
cat "$OUT/timings.tsv"

#!/usr/bin/env bash
# Run NVIDIA aiperf (an external, established benchmark client) against forkjax's
# OpenAI-compatible server: synthetic prompts of exactly ISL tokens, exactly OSL
# output tokens (ignore_eos + min_tokens), streaming, fixed concurrency or rate.
#
#   scripts/bench_external.sh [--url http://127.0.0.1:8000] [--model smollm2-135m]
#       [--tokenizer DIR] [--isl 128] [--osl 128] [--concurrency 8 | --rate 4]
#       [--requests 64] [--warmup 0] [--endpoint completions|chat]
#       [--out ${OUT:-/tmp}/aiperf] [--serve-args "--max-model-len 2048"] [-- aiperf args]
#
# Without --url it starts `python -m forkjax.serve --model MODEL --port 0` and stops
# it afterwards. Without --tokenizer it exports MODEL's tokenizer (from its GGUF)
# to /tmp/forkjax-tokenizer-MODEL with forkjax. aiperf's wheels (scripts/fetch_gpu_wheels.sh)
# are expected installed under $CLIENT_SITE (default /tmp/site) or importable.
# Env: PY (forkjax python; .venv/bin/python if present, else python3),
#      CLIENT_PY (python3), CLIENT_SITE (/tmp/site).
# Writes OUT/profile_export_aiperf.{json,csv}, per-request profile_export.jsonl,
# OUT/aiperf.log, OUT/server.log; prints one summary line at the end.
set -euo pipefail
HERE=$PWD; cd "$(dirname "$0")/.."
URL= MODEL=smollm2-135m TOK= ISL=128 OSL=128 CONC=8 RATE= N=64 WARM=0 EP=completions
OUT=${OUT:-/tmp}/aiperf SERVE_ARGS=  # on the device machine $OUT is the folder that comes back
while [ $# -gt 0 ]; do
  case $1 in
    --url) URL=$2;; --model) MODEL=$2;; --tokenizer) TOK=$2;; --isl) ISL=$2;; --osl) OSL=$2;;
    --concurrency) CONC=$2;; --rate) RATE=$2;; --requests) N=$2;; --warmup) WARM=$2;;
    --endpoint) EP=$2;; --out) OUT=$2;; --serve-args) SERVE_ARGS=$2;;
    --) shift; break;;
    *) echo "unknown arg $1" >&2; exit 2;;
  esac; shift 2
done
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
CLIENT_PY=${CLIENT_PY:-python3}
CLIENT_SITE=${CLIENT_SITE:-/tmp/site}
case $OUT in /*) ;; *) OUT=$HERE/$OUT;; esac; mkdir -p "$OUT"
case $TOK in /*|'') ;; *) TOK=$HERE/$TOK;; esac

if [ -z "$TOK" ]; then
  TOK=${TMPDIR:-/tmp}/forkjax-tokenizer-$MODEL
  [ -e "$TOK/tokenizer.json" ] || "$PY" -c "import sys
from forkjax.engine.loading import describe_model
describe_model(sys.argv[1])[1].tok.save_pretrained(sys.argv[2])" "$MODEL" "$TOK"
fi

SERVER=
cleanup() {  # the server may have an engine-core child: stop it too
  [ -n "$SERVER" ] || return 0; local kids; kids=$(pgrep -P "$SERVER" 2>/dev/null || true)
  kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true
  [ -z "$kids" ] || kill $kids 2>/dev/null || true; }
trap cleanup EXIT
if [ -z "$URL" ]; then
  # shellcheck disable=SC2086
  "$PY" -m forkjax.serve --model "$MODEL" --port 0 $SERVE_ARGS >"$OUT/server.log" 2>&1 &
  SERVER=$!
  until URL=$(grep -o 'forkjax: ready: .* at http://[^ ]*' "$OUT/server.log" 2>/dev/null | sed 's/.* at //'); do
    kill -0 "$SERVER" 2>/dev/null || { tail -30 "$OUT/server.log"; echo "server died" >&2; exit 1; }
    sleep 2
  done
fi
URL=${URL%/}; URL=${URL%/v1}

LOAD=(--concurrency "$CONC") LBL=conc=$CONC; [ -n "$RATE" ] && LOAD=(--request-rate "$RATE") LBL=rate=$RATE
WARMUP=(); [ "$WARM" -gt 0 ] && WARMUP=(--warmup-request-count "$WARM")
CHAT=(); [ "$EP" = chat ] && CHAT=(--apply-chat-template)  # ISL counts the template too
# aiperf treats HF_HUB_OFFLINE as "look the name up in the hub cache", which breaks
# local tokenizer dirs; a local path never touches the network anyway.
env -u HF_HUB_OFFLINE -u TRANSFORMERS_OFFLINE HF_HUB_DISABLE_TELEMETRY=1 \
  NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}" \
  PYTHONPATH="$CLIENT_SITE${PYTHONPATH:+:$PYTHONPATH}" \
  "$CLIENT_PY" -m aiperf profile --model "$MODEL" --url "$URL" --endpoint-type "$EP" --streaming \
  --tokenizer "$TOK" --isl "$ISL" --isl-stddev 0 --osl "$OSL" --osl-stddev 0 \
  --extra-inputs ignore_eos:true --extra-inputs "min_tokens:$OSL" \
  "${LOAD[@]}" --request-count "$N" "${WARMUP[@]}" "${CHAT[@]}" --random-seed 0 \
  --use-server-token-count --ui none --no-server-metrics --no-gpu-telemetry --artifact-dir "$OUT" "$@" \
  >"$OUT/aiperf.log" 2>&1 || { tail -40 "$OUT/aiperf.log"; exit 1; }

"$CLIENT_PY" - "$OUT/profile_export_aiperf.json" "$ISL" "$OSL" "$LBL" "$N" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1])); g = lambda k, s="avg": (d.get(k) or {}).get(s, float("nan"))
print(f"aiperf isl={sys.argv[2]} osl={sys.argv[3]} {sys.argv[4]} n={sys.argv[5]}"
      f" ok={g('request_count'):.0f} err={(d.get('error_request_count') or {}).get('avg', 0):.0f}"
      f" osl_avg={g('output_sequence_length'):.1f} | output {g('output_token_throughput'):.1f} tok/s"
      f" | TTFT p50 {g('time_to_first_token','p50'):.1f} p99 {g('time_to_first_token','p99'):.1f} ms"
      f" | ITL p50 {g('inter_token_latency','p50'):.2f} ms | {g('request_throughput'):.2f} req/s")
EOF

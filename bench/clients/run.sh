#!/usr/bin/env bash
# The benchmark clients people already use, against an engine directly and through
# prefill-gate (holding, and slicing auto). Not part of CI.
#
#   bash bench/clients/run.sh [OUT]        (default out/clients; ~5 min on 2 cores)
#
# Engine: the simulator, started here (this CPU machine), or UPSTREAM (a running vLLM, e.g.
# on the H200: UPSTREAM=http://127.0.0.1:8001 MODEL_NAME=m TOKENIZER=<its model folder>).
# Client: `vllm bench serve` (vLLM 0.26.0's; here from the test .venv, which holds vLLM
# without its dependencies: the few its CLI imports besides are installed to OUT/deps when
# missing, not into .venv), with a local tokenizer (default bench/clients/make_tokenizer.py's:
# a token is a character, as the simulator counts). Two clients at once per target, as in
# `prefill-gate bench mixed`: interactive requests (300-token prompts +-50%, 200 tokens out,
# Poisson RATE/s, default 6) and long prompts (20,000 tokens, 32 out, Poisson LONG_RATE/s,
# default 0.25), for DURATION s. The interactive client's ITL, TTFT and goodput are what the
# comparison reads. CLIENT=aiperf makes the interactive client NVIDIA's AIPerf (`aiperf
# profile`, Poisson arrivals, the same sizes; installed pinned into OUT/aiperf-venv unless
# AIPERF names its binary: ~1.2 GB); the long prompts stay vLLM's client.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-out/clients}
DURATION=${DURATION:-60}
RATE=${RATE:-6}
LONG_RATE=${LONG_RATE:-0.25}
GOODPUT=${GOODPUT:-ttft:150 tpot:15}  # the interactive client's --goodput SLOs
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
MODEL_NAME=${MODEL_NAME:-sim}
CLIENT=${CLIENT:-vllm}
AIPERF_VERSION=0.13.0
mkdir -p "$OUT/deps" "$OUT/res"
OUT=$(cd "$OUT" && pwd)
"$PY" -c "import partial_json_parser, model_hosting_container_standards, jmespath" 2>/dev/null \
  || "$PY" -m pip install -q --no-deps --target "$OUT/deps" partial_json_parser model_hosting_container_standards \
     jmespath 2>&1 | grep -v "^WARNING" || true
if [ -z "${TOKENIZER:-}" ]; then
  TOKENIZER=$OUT/tokenizer
  "$PY" bench/clients/make_tokenizer.py "$TOKENIZER"
fi
if [ "$CLIENT" = aiperf ] && [ -z "${AIPERF:-}" ]; then
  AIPERF=$OUT/aiperf-venv/bin/aiperf
  [ -x "$AIPERF" ] || { python3 -m venv "$OUT/aiperf-venv" \
    && "$OUT/aiperf-venv/bin/python" -m pip install -q "aiperf==$AIPERF_VERSION" 2>&1 | grep -v "^WARNING" || true; }
fi
export PYTHONPATH=$OUT/deps${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
VLLM=("$PY" -m vllm.entrypoints.cli.main)
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT

wait_up() { for _ in $(seq 100); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 0.2; done; return 1; }
count() { "$PY" -c "import sys; print(max(1, round(float(sys.argv[1]) * float(sys.argv[2]))))" "$1" "$2"; }

if [ -z "${UPSTREAM:-}" ]; then
  "$PY" -m prefill_gate.proxy sim --port 8701 --served-model-name "$MODEL_NAME" > "$OUT/res/sim.log" 2>&1 & PIDS+=($!)
  wait_up 8701
  UPSTREAM=http://127.0.0.1:8701
fi
"$PY" -m prefill_gate.proxy serve --upstream "$UPSTREAM" --port 8702 --log-level warning > "$OUT/res/proxy-hold.log" 2>&1 & PIDS+=($!)
"$PY" -m prefill_gate.proxy serve --upstream "$UPSTREAM" --port 8703 --log-level info --slicing auto \
  > "$OUT/res/proxy-auto.log" 2>&1 & PIDS+=($!)
wait_up 8702 && wait_up 8703

common=(--backend openai-chat --endpoint /v1/chat/completions --model "$MODEL_NAME" --tokenizer "$TOKENIZER"
        --dataset-name random --ignore-eos --seed 0 --percentile-metrics ttft,tpot,itl,e2el
        --metric-percentiles 50,99,99.9 --save-result --save-detailed --result-dir "$OUT/res")
for target in "direct $UPSTREAM" "hold http://127.0.0.1:8702" "auto http://127.0.0.1:8703"; do
  label=${target%% *}; url=${target#* }
  echo "[clients] $label: interactive ($RATE/s) + long prompts ($LONG_RATE/s) for ${DURATION} s" >&2
  "${VLLM[@]}" bench serve "${common[@]}" --base-url "$url" --random-input-len 20000 \
    --random-output-len 32 --num-prompts "$(count "$DURATION" "$LONG_RATE")" --request-rate "$LONG_RATE" \
    --result-filename "long-$label.json" > "$OUT/res/long-$label.txt" 2>&1 &
  long=$!
  if [ "$CLIENT" = aiperf ]; then  # vLLM's goodput names in AIPerf's terms (TPOT: its per-request ITL)
    slo=$(echo "$GOODPUT" | sed 's/ttft:/time_to_first_token:/; s/tpot:/inter_token_latency:/')
    env -u PYTHONPATH "$AIPERF" profile --model "$MODEL_NAME" --url "$url" --endpoint-type chat --streaming \
      --tokenizer "$TOKENIZER" --request-rate "$RATE" --arrival-pattern poisson \
      --request-count "$(count "$DURATION" "$RATE")" --prompt-input-tokens-mean 300 --prompt-input-tokens-stddev 75 \
      --prompt-output-tokens-mean 200 --prompt-output-tokens-stddev 0 --extra-inputs ignore_eos:true \
      --random-seed 0 --goodput "$slo" --output-artifact-dir "$OUT/res/aiperf-$label" --ui-type none \
      > "$OUT/res/interactive-$label.txt" 2>&1
  else
    "${VLLM[@]}" bench serve "${common[@]}" --base-url "$url" --random-input-len 300 \
      --random-range-ratio 0.5 --random-output-len 200 --num-prompts "$(count "$DURATION" "$RATE")" \
      --request-rate "$RATE" --goodput $GOODPUT --result-filename "interactive-$label.json" \
      > "$OUT/res/interactive-$label.txt" 2>&1
  fi
  wait "$long"
  curl -s "$url/metrics" > "$OUT/res/metrics-$label.txt" || true
done
"$PY" bench/clients/summary.py "$OUT/res" --json "$OUT/clients.json" | tee "$OUT/clients-table.txt"

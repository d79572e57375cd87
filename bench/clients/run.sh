#!/usr/bin/env bash
# The benchmark clients people already use, against the engine simulator directly and through
# prefill-gate (holding, and slicing auto), on this CPU machine. Not part of CI.
#
#   bash bench/clients/run.sh [OUT]        (default out/clients; ~5 min on 2 cores)
#
# Client: `vllm bench serve` (vLLM 0.26.0's, from the test .venv, which holds vLLM without its
# dependencies: the few its CLI imports besides are installed to OUT/deps, not into .venv),
# with a character-level tokenizer (bench/clients/make_tokenizer.py: a token is a character,
# as the simulator counts). Two clients at once per target, as in `prefill-gate bench mixed`:
# interactive requests (300-token prompts +-50%, 200 tokens out, Poisson 6/s) and long prompts
# (20,000 tokens, 32 out, Poisson 0.25/s). The interactive client's ITL, TTFT and goodput are
# what the comparison reads.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-out/clients}
DURATION=${DURATION:-60}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT/deps" "$OUT/res"
OUT=$(cd "$OUT" && pwd)
"$PY" -m pip install -q --no-deps --target "$OUT/deps" partial_json_parser model_hosting_container_standards jmespath \
  2>&1 | grep -v "^WARNING" || true
"$PY" bench/clients/make_tokenizer.py "$OUT/tokenizer"
export PYTHONPATH=$OUT/deps PYTHONUNBUFFERED=1
VLLM=$(dirname "$PY")/vllm
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT

wait_up() { for _ in $(seq 100); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 0.2; done; return 1; }

"$PY" -m proxy sim --port 8701 --served-model-name sim > "$OUT/res/sim.log" 2>&1 & PIDS+=($!)
wait_up 8701
"$PY" -m proxy serve --upstream http://127.0.0.1:8701 --port 8702 --log-level warning > "$OUT/res/proxy-hold.log" 2>&1 & PIDS+=($!)
"$PY" -m proxy serve --upstream http://127.0.0.1:8701 --port 8703 --log-level warning --slicing auto \
  > "$OUT/res/proxy-auto.log" 2>&1 & PIDS+=($!)
wait_up 8702 && wait_up 8703

common=(--backend openai-chat --endpoint /v1/chat/completions --model sim --tokenizer "$OUT/tokenizer"
        --dataset-name random --ignore-eos --seed 0 --percentile-metrics ttft,tpot,itl,e2el
        --metric-percentiles 50,99,99.9 --save-result --save-detailed --result-dir "$OUT/res")
for target in direct:8701 hold:8702 auto:8703; do
  label=${target%%:*}; port=${target##*:}
  echo "[clients] $label: interactive + long prompts for ${DURATION} s" >&2
  "$VLLM" bench serve "${common[@]}" --base-url "http://127.0.0.1:$port" --random-input-len 20000 \
    --random-output-len 32 --num-prompts $((DURATION / 4)) --request-rate 0.25 \
    --result-filename "long-$label.json" > "$OUT/res/long-$label.txt" 2>&1 &
  long=$!
  "$VLLM" bench serve "${common[@]}" --base-url "http://127.0.0.1:$port" --random-input-len 300 \
    --random-range-ratio 0.5 --random-output-len 200 --num-prompts $((DURATION * 6)) --request-rate 6 \
    --goodput ttft:150 tpot:15 --result-filename "interactive-$label.json" > "$OUT/res/interactive-$label.txt" 2>&1
  wait "$long"
  curl -s "http://127.0.0.1:$port/metrics" > "$OUT/res/metrics-$label.txt" || true
done
"$PY" bench/clients/summary.py "$OUT/res" --json "$OUT/clients.json" | tee "$OUT/clients-table.txt"

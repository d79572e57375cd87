#!/usr/bin/env bash
# PREFILL_GATE_PACING_SUB_BLOCK on the simulator's hybrid presets (issue 50, item 3): the seed
# pair (`bench overlap`) on vLLM's own chunking, on pacing in whole 1,568-token blocks (what
# align mode allowed), and on pacing below the block. A model, not a measurement: the presets
# are fitted to the report's figures (rtx3090-27b-hybrid) and to H200 runs (h200-27b-hybrid).
#
#   bash bench/sim_sub_block.sh [OUT]        (~6 minutes on 2 cores; OUT: bench/results/sim/sub-block)
set -u
OUT=${1:-bench/results/sim/sub-block}
RUNS=${RUNS:-2}
PY=${PY:-python3}
mkdir -p "$OUT"
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done' EXIT

serve() {  # port preset args...
  local port=$1 preset=$2; shift 2
  $PY -m prefill_gate.proxy sim --preset "$preset" --port "$port" "$@" > "${TMPDIR:-/tmp}/sim-$port.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0; sleep 0.2; done
  echo "sim on :$port did not start"; cat "${TMPDIR:-/tmp}/sim-$port.log"; exit 1
}

pair() {  # label port
  $PY -m prefill_gate.proxy bench overlap --base-url "http://127.0.0.1:$2" --model sim --runs "$RUNS" --seed 7 \
    --label "$1" --json "$OUT/pair-$1.json" 2>&1 | grep -v '^\[overlap\]'
}

# rtx3090: the report's own budget (8192); h200: the budget of the H200 hybrid runs (2048)
serve 18301 rtx3090-27b-hybrid
serve 18302 rtx3090-27b-hybrid --pacing-cap 1568
serve 18303 rtx3090-27b-hybrid --pacing-cap 256 --pacing-sub-block
serve 18304 h200-27b-hybrid
serve 18305 h200-27b-hybrid --pacing-cap 1568
serve 18306 h200-27b-hybrid --pacing-cap 256 --pacing-sub-block
pair rtx3090-direct 18301
pair rtx3090-paced-block 18302
pair rtx3090-paced-sub-256 18303
pair h200-hybrid-direct 18304
pair h200-hybrid-paced-block 18305
pair h200-hybrid-paced-sub-256 18306
$PY - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = []
print("| preset, served as | B gap p50 / p99 / max ms during A | B tok/s then | A first token s (alone) |")
print("|---|---|---|---|")
for f in sorted(out.glob("pair-*.json")):
    d = json.loads(f.read_text())
    s = d["spread"]
    rng = lambda k, fmt: "-".join(dict.fromkeys(fmt.format(v) for v in s[k]))
    print(f"| {d['config']} | {rng('overlap_itl_ms_p50', '{:.0f}')} / {rng('overlap_itl_ms_p99', '{:.0f}')} / "
          f"{rng('overlap_itl_ms_max', '{:.0f}')} | {rng('overlap_b_tokens_per_s', '{:.1f}')} | "
          f"{rng('a_ttft_s', '{:.2f}')} ({rng('a_solo_ttft_s', '{:.2f}')}) |")
PYEOF

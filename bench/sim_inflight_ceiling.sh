#!/usr/bin/env bash
# Slices held under a ceiling inside vLLM's CUDA graph, one or two in flight, on the simulator
# (a model, not a GPU): the proxy's steady load (`bench defaults --rows proxy --parts steady`) in
# each of LABELS (default: all), JSON per run and a table in OUT:
#   uncapped   the slicer as it is, on the default (H200) preset
#   capped-1   slices capped at CAP tokens, as `SliceSizer.ceiling` caps them after eager steps
#              broke the promise (489-504 tokens on the H100 of
#              bench/results/defaults/h100/run-f5b6617/), one in flight
#   capped-2   the same, two in flight (`--slice-inflight=2`)
#   tail-1     no cap: a stock simulator whose eager steps (past 512 tokens) cost 20 ms more and
#              1 in 20 of them 80 ms more again (the H100's tail), so the slicer's own ceiling
#              comes; the proxy's defaults
#   tail-2     the same with `--slice-inflight-capped=2`
#   bash bench/sim_inflight_ceiling.sh [OUT] [SEEDS] [DURATION]
set -eu
OUT=${1:-bench/results/sim/inflight-ceiling}
SEEDS=${2:-0}
DURATION=${3:-60}
CAP=${CAP:-496}
mkdir -p "$OUT"
source "$(dirname "$0")/sim_lib.sh"
TAIL="--cost-graph-tokens 512 --cost-eager 0.020 --cost-eager-tail 0.05 --cost-eager-tail-s 0.080"
for label in ${LABELS:-uncapped capped-1 capped-2 tail-1 tail-2}; do
  extra=() STOCK_SIM_ARGS=""
  case $label in
    uncapped) ;;
    capped-1) extra=(--proxy-arg=--max-slice-tokens=$CAP) ;;
    capped-2) extra=(--proxy-arg=--max-slice-tokens=$CAP --proxy-arg=--slice-inflight=2) ;;
    tail-1) STOCK_SIM_ARGS=$TAIL ;;
    tail-2) STOCK_SIM_ARGS=$TAIL extra=(--proxy-arg=--slice-inflight-capped=2) ;;
    *) echo "unknown label $label"; exit 2 ;;
  esac
  for seed in $SEEDS; do
    defaults_on_sims "$OUT/$label-seed$seed.json" "$OUT/$label-seed$seed-slices.log" -- \
      --rows proxy --parts steady --duration "$DURATION" --seed "$seed" "${extra[@]}"
  done
done
python3 "$(dirname "$0")/sim_table.py" "$OUT" proxy steady "slices=slices a prompt p50" \
  "itl_ms_p99=gaps p99 ms" itl_ms_p999=p99.9 itl_ms_max=max "ttft_ms_p99=new TTFT p99 ms" \
  "long_x_p50=long p50 x alone" long_x_p90=p90

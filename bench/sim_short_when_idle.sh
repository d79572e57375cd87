#!/usr/bin/env bash
# PREFILL_GATE_PACING_SHORT_WHEN_IDLE on the simulator (a model, not the H200): the stack row's
# sparse users (`bench defaults --rows stack --parts sparse`: 3 users who pause often, a 20k
# prompt every ~4 s, 60 s) with a paced simulator as compose's stack paces (cap mode, short
# prompts first) and with the setting on, per seed; JSON and table per run in OUT.
#   bash bench/sim_short_when_idle.sh [OUT] [SEEDS]
set -eu
OUT=${1:-bench/results/sim/short-when-idle}
SEEDS=${2:-0 1}
mkdir -p "$OUT"
source "$(dirname "$0")/sim_lib.sh"
for label in plain idle; do
  PACED_SIM_ARGS=""; [ $label = idle ] && PACED_SIM_ARGS=--pacing-short-when-idle
  for seed in $SEEDS; do
    defaults_on_sims "$OUT/$label-seed$seed.json" -- --rows stack --parts sparse --sparse-duration 60 --seed "$seed"
  done
done
python3 "$(dirname "$0")/sim_table.py" "$OUT" stack sparse "ttft_ms_p50=new TTFT p50 ms" ttft_ms_p99=p99 \
  ttft_ms_max=max "long_ttft_s_p50=long p50 s" long_ttft_s_p90=p90 "itl_ms_p99=gaps p99 ms" itl_ms_max=max

#!/usr/bin/env bash
# PREFILL_GATE_PACING_LONG_MIN_SHARE on the hybrid's simulator (a model, not a GPU): the stack row's
# steady load (`bench defaults --checks hybrid --rows stack --parts steady`: 8 users, a 20k prompt
# every ~10 s, 90 s) against the stock hybrid preset and the stack's (paced at 320 tokens below the
# align block, short prompts first), for each share of a bounded step a long prompt keeps while
# short prompts wait, per seed; JSON per run in OUT.
#   bash bench/sim_long_min_share.sh [OUT] [SEEDS] [SHARES]
set -u
OUT=${1:-bench/results/sim/long-min-share-hybrid}
SEEDS=${2:-0 1}
SHARES=${3:-0.5 0.25 0}
mkdir -p "$OUT"
port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
up() { for _ in $(seq 100); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 0.1; done; return 1; }
for seed in $SEEDS; do
  for share in $SHARES; do
    stock=$(port) paced=$(port)
    python3 -m prefill_gate sim --port "$stock" --preset h200-27b-hybrid >/dev/null 2>&1 & s1=$!
    python3 -m prefill_gate sim --port "$paced" --preset h200-27b-hybrid-stack --pacing-cap 320 --pacing-sub-block \
      --pacing-long-min-share "$share" >/dev/null 2>&1 & s2=$!
    up "$stock" && up "$paced"
    work=$(mktemp -d)
    python3 -m prefill_gate bench defaults --stock "http://127.0.0.1:$stock" --paced "http://127.0.0.1:$paced" \
      --checks hybrid --users 8 --long-every 10 --rows stack --parts steady --duration 90 --seed "$seed" \
      --work "$work" --json "$OUT/share$share-seed$seed.json" >/dev/null 2>&1
    kill $s1 $s2; wait $s1 $s2 2>/dev/null || true; rm -rf "$work"
  done
done

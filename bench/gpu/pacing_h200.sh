#!/usr/bin/env bash
# Step pacing (engine_patches) against vLLM's own knobs on real vLLM 0.26.0, proxy off.
#
# On the GPU machine, after the recipe's chunk-only first run:
#   source .gpu/device_setup.sh setup && BATCH=1 bash bench/gpu/pacing_h200.sh "$OUT"
#   (next run, same machine)              BATCH=2 bash bench/gpu/pacing_h200.sh "$OUT"
# Here, against the simulator (pacing itself is then not exercised: the flow only):
#   DRY_RUN=1 BATCH=1 bash bench/gpu/pacing_h200.sh out/pacing-dry
#
# One paced server per batch runs every pacing setting in turn: its scheduler re-reads
# PREFILL_GATE_PACING_CONTROL_FILE, so a sweep needs no restart (and no recompile).
# vLLM's knobs need a server each. Each configuration: the seed shape (`bench overlap`,
# which also measures A alone on the same server), RUNS times.
#   BATCH=1: unpatched 8192; paced 8192 (off, cap 512/256/128, cadence 1, adaptive
#            15/20/30 ms); --max-num-batched-tokens 512, 256
#   BATCH=2: paced 8192 with full CUDA graphs for mixed steps (cudagraph_mode FULL:
#            off, cap 256/128/64, adaptive 12/15 ms); --max-num-batched-tokens 128;
#            --long-prefill-token-threshold 511, 256, 128
# Writes <config>.json/.png, logs, packed in OUT/pacing-<batch>.tar.gz.
set -u
OUT=${1:-out/pacing}
BATCH=${BATCH:-1}
MODEL=${MODEL:-.gpu/model-qwen3-8b}
RUNS=${RUNS:-2}
UTIL=${UTIL:-0.15}
KV_BYTES=${KV_BYTES:-6442450944}  # 6 GiB each (one 32k-token sequence needs ~4.7 GB)
STAGGER=${STAGGER:-8}
DEADLINE=${DEADLINE:-540}  # seconds after start: no new bench begins past this
WORK=${WORK:-$OUT}  # where results accumulate; the device returns few files: set WORK=/root/pacing there
mkdir -p "$OUT" "$WORK/res-$BATCH"
RES=$(cd "$WORK/res-$BATCH" && pwd)
source bench/gpu/lib.sh
PACED_CLS=engine_patches.pacing.PacedAsyncScheduler

case $BATCH in
  1) SERVERS=(
       "stock-8192 8001 --max-num-batched-tokens 8192"
       "paced 8002 --max-num-batched-tokens 8192 --scheduler-cls $PACED_CLS"
       "mnbt-512 8003 --max-num-batched-tokens 512"
       "mnbt-256 8004 --max-num-batched-tokens 256")
     PACED="paced"
     SETTINGS=("off" "cap:512" "cap:256" "cap:128" "cadence:1" "adaptive:15" "adaptive:20" "adaptive:30") ;;
  2) SERVERS=(
       "paced-full 8005 --max-num-batched-tokens 8192 --scheduler-cls $PACED_CLS --compilation-config {\"cudagraph_mode\":\"FULL\"}"
       "mnbt-128 8006 --max-num-batched-tokens 128"
       "lpt-511 8007 --max-num-batched-tokens 8192 --long-prefill-token-threshold 511"
       "lpt-256 8008 --max-num-batched-tokens 8192 --long-prefill-token-threshold 256"
       "lpt-128 8009 --max-num-batched-tokens 8192 --long-prefill-token-threshold 128")
     PACED="paced-full"
     SETTINGS=("off" "cap:256" "cap:128" "cap:64" "adaptive:12" "adaptive:15") ;;
  *) echo "BATCH must be 1 or 2"; exit 2 ;;
esac
CONTROL=$RES/control-$PACED.env
echo "PREFILL_GATE_PACING=off" > "$CONTROL"
export PREFILL_GATE_PACING_CONTROL_FILE=$CONTROL PREFILL_GATE_PACING_LOG_INTERVAL_S=5
trap cleanup EXIT

gpu_info
for s in "${SERVERS[@]}"; do
  set -- $s; name=$1; port=$2; shift 2
  say "starting $name on :$port ($*)"
  start_server "$name" "$port" "$@"
  sleep "$STAGGER"
done
for s in "${SERVERS[@]}"; do
  set -- $s; name=$1; port=$2
  if wait_health "$port" 420 "${PID_OF[$name]}"; then say "$name healthy"
  else say "$name did not come up"; tail -20 "$RES/server-$name.log"; fi
done

late() { [ $(( $(date +%s) - t0 )) -gt "$DEADLINE" ] && say "deadline: skipping $1" ; }
set_pacing() {  # mode[:value]
  local mode=${1%%:*} value=${1#*:}
  case $mode in
    off) echo "PREFILL_GATE_PACING=off" ;;
    cap) printf 'PREFILL_GATE_PACING=cap\nPREFILL_GATE_PACING_CAP_TOKENS=%s\n' "$value" ;;
    cadence) printf 'PREFILL_GATE_PACING=cadence\nPREFILL_GATE_PACING_INTERVAL=%s\n' "$value" ;;
    adaptive) printf 'PREFILL_GATE_PACING=adaptive\nPREFILL_GATE_PACING_TARGET_ITL_MS=%s\nPREFILL_GATE_PACING_CAP_TOKENS=64\n' "$value" ;;
  esac > "$CONTROL.tmp" && mv "$CONTROL.tmp" "$CONTROL"
  sleep 1
}

for s in "${SERVERS[@]}"; do
  set -- $s; name=$1; port=$2
  curl -sf "http://127.0.0.1:$port/health" >/dev/null || continue
  if [ "$name" = "$PACED" ]; then
    for setting in "${SETTINGS[@]}"; do
      late "$name $setting" && continue
      set_pacing "$setting"
      bench "$name-${setting/:/-}" "http://127.0.0.1:$port"
    done
  else
    late "$name" && continue
    bench "$name" "http://127.0.0.1:$port"
  fi
done
grep -h "prefill-gate" "$RES"/server-paced*.log | tail -40 > "$RES/pacing-decisions.log" 2>/dev/null
python3 bench/gpu/pacing_report.py "$RES" --out "$RES" || true
tar czf "$OUT/pacing-$BATCH.tar.gz" -C "$RES" .
cp "$RES/pacing-summary.md" "$OUT/pacing-summary-$BATCH.md" 2>/dev/null
say "done"

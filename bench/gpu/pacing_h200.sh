#!/usr/bin/env bash
# Step pacing (engine_patches) against vLLM's own knobs on real vLLM 0.26.0, proxy off.
#
# On the GPU machine, after the recipe's chunk-only first run:
#   source .gpu/device_setup.sh setup && BATCH=1 bash bench/gpu/pacing_h200.sh "$OUT"
#   (later runs)                          BATCH=2 (then 3) bash bench/gpu/pacing_h200.sh "$OUT"
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
#            off, cap 256/128/64, adaptive 12/15 ms); paced 8192 as paced-fb (adaptive 15/20/25/30 ms, with the
#            quantile feedback added after batch 1);
#            --long-prefill-token-threshold 511, 256, 128
#   BATCH=3: --max-num-batched-tokens 128
#   BATCH=4: paced 8192, full CUDA graphs and a separate Inductor compile for steps of
#            <= 512 tokens (compile_ranges_endpoints [512, 8192]): cap 256/128/64,
#            adaptive 12/15 ms, off
#   BATCH=5: steps that fill a CUDA-graph size (GRAPH_ALIGN, the new default) against the
#            old unaligned caps and vLLM's budget, side by side: --max-num-batched-tokens
#            256 and 128 (default graphs), 256 with full graphs; paced 8192 (cap 256/128
#            aligned and not, adaptive 15/20, adaptive 15 with STEP_QUANTUM 128); paced
#            8192 with full graphs (cap 128, adaptive 12/15)
#   BATCH=7: every method in one run, two waves of servers (GPU memory holds five):
#            unpatched 8192, --long-prefill-token-threshold 256, --max-num-batched-tokens
#            256, paced 8192 (cap 256, adaptive 15/20), paced full graphs (cap 128,
#            adaptive 12/15/18); then threshold 128 and budget 128 (default graphs), budget
#            128 and 256 (full graphs), and paced-cold: a paced server whose first setting
#            is adaptive (15, then 18 ms), so its first overlap starts from an empty fit.
#            WAVES="1" then WAVES="2" split it over two calls of a warm machine (WORK
#            keeps the results of both); the default "1 2" needs ~11 minutes.
#   BATCH=8: batch 7's servers again, after adaptive mode's fit changed (a window for the
#            steps with prefill, a cold start counted in mixed steps).
#   BATCH=9: the default-graph pairs at both sizes in one short run: budget 128 and 256
#            against pacing cap 128 and 256 (batch 8 had no paced cap 128 on default graphs).
#   BATCH=10: one paced server, cap 256 then adaptive 15 ms, with TRACE=1: every step the
#            scheduler made (PREFILL_GATE_PACING_TRACE_FILE) in trace-<server>.jsonl.
# Any batch: TRACE=1 traces every paced server's steps; GPU_CLOCKS=1 samples the GPU's SM
# clock, power and temperature through each bench (gpu-clocks-<config>.csv).
#   BATCH=6: adaptive mode after batch 5's collapse (the aim scales only the prefill's
#            share of the target; an out-of-reach target falls back to CAP_TOKENS), both
#            graph modes, next to vLLM's budget in both: --max-num-batched-tokens 256
#            (default and full graphs) and 128 (full graphs); paced 8192 (cap 256,
#            adaptive 15/20); paced 8192 full graphs (cap 256/128, adaptive 12/15/18)
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
PACED_CLS=prefill_gate.engine_patches.pacing.PacedAsyncScheduler

case $BATCH in
  1) SERVERS=(
       "stock-8192 8001 --max-num-batched-tokens 8192"
       "paced 8002 --max-num-batched-tokens 8192 --scheduler-cls $PACED_CLS"
       "mnbt-512 8003 --max-num-batched-tokens 512"
       "mnbt-256 8004 --max-num-batched-tokens 256")
     SETTINGS_paced="off cap:512 cap:256 cap:128 cadence:1 adaptive:15 adaptive:20 adaptive:30" ;;
  2) SERVERS=(
       "paced-full 8005 --max-num-batched-tokens 8192 --scheduler-cls $PACED_CLS --compilation-config {\"cudagraph_mode\":\"FULL\"}"
       "paced-fb 8002 --max-num-batched-tokens 8192 --scheduler-cls $PACED_CLS"
       "lpt-511 8007 --max-num-batched-tokens 8192 --long-prefill-token-threshold 511"
       "lpt-256 8008 --max-num-batched-tokens 8192 --long-prefill-token-threshold 256"
       "lpt-128 8009 --max-num-batched-tokens 8192 --long-prefill-token-threshold 128")
     SETTINGS_paced_full="off cap:256 cap:128 cap:64 adaptive:12 adaptive:15"
     SETTINGS_paced_fb="adaptive:15 adaptive:20 adaptive:25 adaptive:30" ;;
  3) SERVERS=("mnbt-128 8006 --max-num-batched-tokens 128") ;;
  4) SERVERS=(
       "paced-fullcr 8010 --max-num-batched-tokens 8192 --scheduler-cls $PACED_CLS --compilation-config {\"cudagraph_mode\":\"FULL\",\"compile_ranges_endpoints\":[512,8192]}")
     SETTINGS_paced_fullcr="cap:256 cap:128 cap:64 adaptive:12 adaptive:15 off" ;;
  5) SERVERS=(
       "mnbt-256 8004 --max-num-batched-tokens 256"
       "mnbt-128 8006 --max-num-batched-tokens 128"
       "paced 8002 --max-num-batched-tokens 8192 --scheduler-cls $PACED_CLS"
       "paced-full 8005 --max-num-batched-tokens 8192 --scheduler-cls $PACED_CLS --compilation-config {\"cudagraph_mode\":\"FULL\"}"
       "mnbt-256-full 8011 --max-num-batched-tokens 256 --compilation-config {\"cudagraph_mode\":\"FULL\"}")
     SETTINGS_paced="cap:256 cap:256:noalign cap:128 cap:128:noalign adaptive:15 adaptive:15:q128 adaptive:20"
     SETTINGS_paced_full="cap:128 adaptive:12 adaptive:15" ;;
  6) SERVERS=(
       "mnbt-256 8004 --max-num-batched-tokens 256"
       "mnbt-256-full 8011 --max-num-batched-tokens 256 --compilation-config {\"cudagraph_mode\":\"FULL\"}"
       "mnbt-128-full 8012 --max-num-batched-tokens 128 --compilation-config {\"cudagraph_mode\":\"FULL\"}"
       "paced 8002 --max-num-batched-tokens 8192 --scheduler-cls $PACED_CLS"
       "paced-full 8005 --max-num-batched-tokens 8192 --scheduler-cls $PACED_CLS --compilation-config {\"cudagraph_mode\":\"FULL\"}")
     SETTINGS_paced="cap:256 adaptive:15 adaptive:20"
     SETTINGS_paced_full="cap:256 cap:128 adaptive:12 adaptive:15 adaptive:18" ;;
  7|8) SERVERS=(
       "stock-8192 8001 --max-num-batched-tokens 8192"
       "lpt-256 8008 --max-num-batched-tokens 8192 --long-prefill-token-threshold 256"
       "mnbt-256 8004 --max-num-batched-tokens 256"
       "paced 8002 --max-num-batched-tokens 8192 --scheduler-cls $PACED_CLS"
       "paced-full 8005 --max-num-batched-tokens 8192 --scheduler-cls $PACED_CLS --compilation-config {\"cudagraph_mode\":\"FULL\"}")
     SERVERS2=(
       "mnbt-128 8006 --max-num-batched-tokens 128"
       "lpt-128 8009 --max-num-batched-tokens 8192 --long-prefill-token-threshold 128"
       "mnbt-128-full 8012 --max-num-batched-tokens 128 --compilation-config {\"cudagraph_mode\":\"FULL\"}"
       "mnbt-256-full 8011 --max-num-batched-tokens 256 --compilation-config {\"cudagraph_mode\":\"FULL\"}"
       "paced-cold 8013 --max-num-batched-tokens 8192 --scheduler-cls $PACED_CLS")
     SETTINGS_paced="cap:256 adaptive:15 adaptive:20"
     SETTINGS_paced_full="cap:128 adaptive:12 adaptive:15 adaptive:18"
     SETTINGS_paced_cold="adaptive:15 adaptive:18" ;;
  9) SERVERS=(
       "mnbt-128 8006 --max-num-batched-tokens 128"
       "mnbt-256 8004 --max-num-batched-tokens 256"
       "paced 8002 --max-num-batched-tokens 8192 --scheduler-cls $PACED_CLS")
     SETTINGS_paced="cap:128 cap:256" ;;
  10) SERVERS=("paced 8002 --max-num-batched-tokens 8192 --scheduler-cls $PACED_CLS")
      SETTINGS_paced="cap:256 adaptive:15" ;;
  *) echo "BATCH must be 1 to 10"; exit 2 ;;
esac
export PREFILL_GATE_PACING_LOG_INTERVAL_S=5
trap cleanup EXIT

late() { [ $(( $(date +%s) - t0 )) -gt "$DEADLINE" ] && say "deadline: skipping $1" ; }
set_pacing() {  # server mode[:value[:variant]]; variant noalign (GRAPH_ALIGN=0) or q<N> (STEP_QUANTUM)
  local control=$RES/control-$1.env mode=${2%%:*} rest=${2#*:} value variant=""
  value=${rest%%:*}; [ "$rest" != "$value" ] && variant=${rest#*:}
  { case $variant in
      noalign) echo "PREFILL_GATE_PACING_GRAPH_ALIGN=0" ;;
      q*) echo "PREFILL_GATE_PACING_STEP_QUANTUM=${variant#q}" ;;
    esac
  case $mode in
    off) echo "PREFILL_GATE_PACING=off" ;;
    cap) printf 'PREFILL_GATE_PACING=cap\nPREFILL_GATE_PACING_CAP_TOKENS=%s\n' "$value" ;;
    cadence) printf 'PREFILL_GATE_PACING=cadence\nPREFILL_GATE_PACING_INTERVAL=%s\n' "$value" ;;
    adaptive) printf 'PREFILL_GATE_PACING=adaptive\nPREFILL_GATE_PACING_TARGET_ITL_MS=%s\nPREFILL_GATE_PACING_CAP_TOKENS=%s\n' \
                "$value" "${ADAPTIVE_CAP:-64}" ;;
  esac; } > "$control.tmp" && mv "$control.tmp" "$control"
  sleep 1
}

start_wave() {  # start the servers of one wave (an array's name), wait for their health
  local -n wave=$1
  local s name port
  for s in "${wave[@]}"; do
    set -- $s; name=$1; port=$2; shift 2
    say "starting $name on :$port ($*)"
    echo "PREFILL_GATE_PACING=off" > "$RES/control-$name.env"
    PREFILL_GATE_PACING_TRACE_FILE=$([ "${TRACE:-0}" = 1 ] && echo "$RES/trace-$name.jsonl") \
      PREFILL_GATE_PACING_CONTROL_FILE=$RES/control-$name.env start_server "$name" "$port" "$@"
    sleep "$STAGGER"
  done
  for s in "${wave[@]}"; do
    set -- $s; name=$1; port=$2
    if wait_health "$port" 420 "${PID_OF[$name]}"; then say "$name healthy"
    else say "$name did not come up"; tail -20 "$RES/server-$name.log"; fi
  done
}

bench_wave() {  # bench every server of a wave; a paced one once per setting in its SETTINGS_
  local -n wave=$1
  local s name port settings_var setting
  for s in "${wave[@]}"; do
    set -- $s; name=$1; port=$2
    curl -sf "http://127.0.0.1:$port/health" >/dev/null || continue
    settings_var=SETTINGS_${name//-/_}
    if [ -n "${!settings_var:-}" ]; then
      for setting in ${!settings_var}; do
        late "$name $setting" && continue
        set_pacing "$name" "$setting"
        bench "$name-${setting//:/-}" "http://127.0.0.1:$port"
      done
    else
      late "$name" && continue
      bench "$name" "http://127.0.0.1:$port"
    fi
  done
}

gpu_info
started=0
for wave in ${WAVES:-1 2}; do  # wave 2 (SERVERS2, where a batch has one) once wave 1 is stopped
  servers=SERVERS; [ "$wave" = 2 ] && servers=SERVERS2
  declare -p "$servers" >/dev/null 2>&1 || continue
  if [ $started = 1 ]; then say "wave $wave: stopping the previous wave"; cleanup; PIDS=(); fi
  started=1
  start_wave "$servers"
  bench_wave "$servers"
done
grep -h "prefill-gate" "$RES"/server-paced*.log | tail -40 > "$RES/pacing-decisions.log" 2>/dev/null
python3 bench/gpu/pacing_report.py "$RES" --out "$RES" || true
tar czf "$OUT/pacing-$BATCH.tar.gz" -C "$RES" .
cp "$RES/pacing-summary.md" "$OUT/pacing-summary-$BATCH.md" 2>/dev/null
say "done"

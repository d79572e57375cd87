#!/usr/bin/env bash
# Issue 50, item 1: CUDA graphs past vLLM's own capture sizes (engine_patches.graphs) against
# vLLM's, side by side on one H200, in calls that resume (servers outlive a call, results
# accumulate in WORK, a row already there is skipped, DEADLINE: no new row past it).
# bench/results/graphs/h200/README.md holds what it measured (graphs.py's default follows it).
#
#   STAGE=dense-start  start :8001, the paced 8B server with full graphs up to 8,192 tokens
#                      (PREFILL_GATE_GRAPH_STEPS=8192), and return; defaults_h200.sh's paced
#                      :8002 is the stack's (vLLM's own sizes up to 512: auto adds none there)
#   STAGE=dense        on both: the seed pair (PAIR_RUNS, 3); with DENSE_SHORT=1 also `bench short`
#   STAGE=hybrid       the 8B servers stopped; the 27B hybrid (bench/gpu/hybrid_model.py) at the
#                      report's budget (2,048, prefix caching, fp8 KV) twice: :8001 stock vLLM (graphs
#                      up to 2 x --max-num-seqs = 128 tokens), :8002 the paced scheduler with graphs
#                      up to HYBRID_GRAPHS tokens (2048; auto's 512 captures the same sizes for
#                      steps of up to 512 tokens) with pacing off (vLLM's own scheduling: the graphs alone), then pacing
#                      adaptive 15 ms (the stack's setting); rows: `bench short` (4 streams, a
#                      200-400-token prompt every ~1.2 s, SHORT_DURATION s) and the seed pair
#
#   source .gpu/device_setup.sh setup && STAGE=hybrid DEADLINE=420 bash bench/gpu/graphs_h200.sh "$OUT"
# Here, on simulators (no graphs: the rows run, the numbers mean nothing):
#   DRY_RUN=1 STAGE=hybrid bash bench/gpu/graphs_h200.sh out/graphs-sim
set -u
OUT=${1:-out/graphs}
STAGE=${STAGE:-hybrid}
WORK=${WORK:-/root/graphs}
[ "${DRY_RUN:-0}" = 1 ] && WORK=${WORK_DRY:-$OUT/work}
RUNS=${PAIR_RUNS:-3}
SHORT_DURATION=${SHORT_DURATION:-45}
mkdir -p "$OUT" "$WORK/${STAGE%-start}"
RES=$(cd "$WORK/${STAGE%-start}" && pwd)
case $STAGE in
  hybrid) MODEL=${MODEL:-.gpu/model-hybrid-27b} UTIL=${UTIL:-0.45} KV_BYTES=${KV_BYTES:-10737418240} ;;
  *) MODEL=${MODEL:-.gpu/model-qwen3-8b} UTIL=${UTIL:-0.2} KV_BYTES=${KV_BYTES:-17179869184} ;;
esac
source bench/gpu/lib.sh
if [ "${DRY_RUN:-0}" != 1 ]; then  # the plugin's entry point: without it no graphs are added
  [ -f .gpu/ep/prefill_gate-0.1.0.dist-info/entry_points.txt ] || { say "no .gpu/ep (bench/gpu/dist_info.py)"; exit 2; }
  export PYTHONPATH=$PYTHONPATH:$PWD/.gpu/ep
fi
up() { curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1; }
deadline_passed() { [ "${DEADLINE:-0}" -gt 0 ] && [ $(( $(date +%s) - t0 )) -ge "$DEADLINE" ]; }
PACED_CLS=prefill_gate.engine_patches.pacing.PacedAsyncScheduler

stop_servers_on_ports() {  # whatever serves :8001/:8002 (started by an earlier call, each in its own
                           # process group): SIGINT to the group, up to 60 s to free the GPU, then SIGKILL
  local pids pid i
  pids=$(pgrep -f "serve .*--port 800[12] " || true)
  [ -n "$pids" ] || return 0
  for pid in $pids; do kill -INT -- "-$pid" 2>/dev/null; done
  for i in $(seq 60); do pgrep -f "serve .*--port 800[12] " >/dev/null || break; sleep 1; done
  for pid in $pids; do kill -KILL -- "-$pid" 2>/dev/null; done
  sleep 3
  say "stopped the servers on :8001/:8002"
}

row() {  # kind label url: one resumable row (short | pair)
  local kind=$1 label=$2 url=$3
  if [ -f "$RES/$kind-$label.json" ]; then say "$kind $label: done already"; return 0; fi
  if deadline_passed; then say "$kind $label: left for the next call (DEADLINE)"; return 0; fi
  say "$kind $label -> $url"
  if [ "$kind" = short ]; then
    python3 -m prefill_gate bench short --base-url "$url" --model m --label "$label" --duration "$SHORT_DURATION" \
      --json "$RES/short-$label.json" 2>&1 | grep -v '^\[short\]' | tee -a "$RES/bench.log"
  else
    python3 -m prefill_gate bench overlap --base-url "$url" --model m --runs "$RUNS" --label "$label" \
      --json "$RES/pair-$label.json" --plot "$RES/pair-$label.png" 2>&1 | grep -v '^\[overlap\]' | tee -a "$RES/bench.log"
  fi
}

pacing() {  # KEY=VALUE...: the paced server's settings, through its control file
  printf '%s\n' "$@" > "$RES/control.env.tmp" && mv "$RES/control.env.tmp" "$RES/control.env"; sleep 1
}

graph_notes() {  # what each server captured, and what it cost
  grep -h "prefill-gate CUDA graphs\|Graph capturing finished\|Model loading took\|init engine" \
    "$RES"/server-*.log > "$RES/graphs.txt" 2>/dev/null
  cat "$RES/graphs.txt"
}

gpu_info
case $STAGE in
  dense-start)
    up 8001 || PREFILL_GATE_GRAPH_STEPS=8192 PREFILL_GATE_PACING=adaptive PREFILL_GATE_PACING_TARGET_ITL_MS=15 \
      start_server paced-8192 8001 --max-num-batched-tokens 8192 --enable-prompt-tokens-details \
      --scheduler-cls "$PACED_CLS" --compilation-config '{"cudagraph_mode":"FULL"}'
    say "started :8001 (paced, graphs up to 8192)"; exit 0 ;;
  dense)
    wait_health 8001 420 || { say ":8001 is not up"; exit 1; }
    wait_health 8002 60 || { say ":8002 is not up (defaults_h200.sh starts it)"; exit 1; }
    grep -h "prefill-gate CUDA graphs\|Graph capturing finished" "$RES"/server-*.log /root/defaults/server-paced.log \
      > "$RES/graphs.txt" 2>/dev/null; cat "$RES/graphs.txt"
    row pair paced-graphs-512 http://127.0.0.1:8002
    row pair paced-graphs-8192 http://127.0.0.1:8001
    if [ "${DENSE_SHORT:-0}" = 1 ]; then  # a 300-token prompt + decodes fits vLLM's own 512: little to see
      row short paced-graphs-512 http://127.0.0.1:8002
      row short paced-graphs-8192 http://127.0.0.1:8001
    fi ;;
  hybrid)
    # up already only if both serve this stage's model (an earlier stage's 8B servers are stopped)
    if ! { up 8001 && up 8002 && pgrep -f "serve $MODEL .*--port 8001 " >/dev/null \
           && pgrep -f "serve $MODEL .*--port 8002 " >/dev/null; }; then
      stop_servers_on_ports
      COMMON=(--language-model-only --kv-cache-dtype fp8 --enable-prompt-tokens-details --max-num-seqs 64
              --additional-config '{"gdn_prefill_backend": "triton"}' --enable-prefix-caching --max-num-batched-tokens 2048)
      [ "${DRY_RUN:-0}" = 1 ] && COMMON=(--preset h200-27b-hybrid --max-num-batched-tokens 2048 --max-num-seqs 64)
      pacing PREFILL_GATE_PACING=off
      start_server stock 8001 "${COMMON[@]}"
      sleep 15
      PREFILL_GATE_PACING_CONTROL_FILE=$RES/control.env PREFILL_GATE_PACING_LOG_INTERVAL_S=10 \
        PREFILL_GATE_GRAPH_STEPS=${HYBRID_GRAPHS:-2048} start_server graphs 8002 "${COMMON[@]}" --scheduler-cls "$PACED_CLS"
      for s in stock:8001 graphs:8002; do
        wait_health "${s#*:}" 480 "${PID_OF[${s%:*}]}" || { say "${s%:*} did not come up"; tail -40 "$RES/server-${s%:*}.log"; exit 1; }
      done
      say "servers healthy"
    fi
    graph_notes
    pacing PREFILL_GATE_PACING=off
    row short stock-2048 http://127.0.0.1:8001
    row short graphs-2048 http://127.0.0.1:8002
    pacing PREFILL_GATE_PACING=adaptive PREFILL_GATE_PACING_TARGET_ITL_MS=15
    row short paced-graphs-2048 http://127.0.0.1:8002
    row pair paced-graphs-2048 http://127.0.0.1:8002
    pacing PREFILL_GATE_PACING=off
    row pair graphs-2048 http://127.0.0.1:8002
    row pair stock-2048 http://127.0.0.1:8001 ;;
  *) say "STAGE must be dense-start, dense or hybrid"; exit 2 ;;
esac
pack_results "graphs-$STAGE"

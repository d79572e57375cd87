#!/usr/bin/env bash
# Steady load (`prefill-gate bench mixed`) on real vLLM 0.26.0: every way of serving it,
# side by side, in one run (over several calls of one warm machine if need be).
#
# On the GPU machine, after the recipe's chunk-only first run:
#   source .gpu/device_setup.sh setup && WORK=/root/mixed ROWS="direct hold" bash bench/gpu/mixed_h200.sh "$OUT"
#   (next call, servers still up)        WORK=/root/mixed ROWS="slice-on ..." bash bench/gpu/mixed_h200.sh "$OUT"
# Here, against simulators (a paced simulator per short-first setting):
#   DRY_RUN=1 TIME_SCALE=1 bash bench/gpu/mixed_h200.sh out/mixed-sim
#
# Two vLLM servers (started once; they stay up between calls, started with setsid):
#   stock   --max-num-batched-tokens 8192 --enable-prompt-tokens-details
#   paced   the same + PacedAsyncScheduler, adaptive 15 ms, full CUDA graphs; its pacing
#           settings switch between rows through PREFILL_GATE_PACING_CONTROL_FILE
# Rows (ROWS, in order; default all):
#   direct       stock vLLM
#   hold         prefill-gate, default settings (holds long prompts) -> stock
#   slice-on     prefill-gate --slicing on -> stock
#   slice-auto   prefill-gate --slicing auto -> stock (its log has each sliced prompt's slices)
#   slice-auto-45  the same, aiming slices at 45 ms (--slice-gap-ms 45; max_gap_ms stays 50)
#   paced        the paced server, short-first off (SHORT_TOKENS=0): plain pacing
#   paced-short  the paced server, short-first on (the default, 1024)
#   loop         prefill-gate --itl-slo-ms 20 -> the paced server, short-first on
#   frontier     the seed pair (bench overlap, A alone too) through prefill-gate slicing at
#                fixed sizes 256, 512, 1024 and with feedback; the paced server's seed pair
#                with short-first off and on
#   slice-pipe   the same with two slices in flight (--slice-inflight 2)
#   slice-graph  two in flight, every slice GRAPH_SLICE tokens (480: with the streams' decodes
#                a step within vLLM's largest CUDA graph, 512 tokens)
#   slice-idle   prefill-gate --slicing auto --slice-when-idle -> stock
#   sparse-auto, sparse-idle   the same two with few users (SPARSE_ARGS: 3 users, 2 s think),
#                so that long prompts often arrive with nothing protected live
#   pair-auto    the seed pair through prefill-gate --slicing auto (what the rule chose)
#   pair-headline  the seed pair, RUNS=3, direct and through prefill-gate's defaults (the
#                README's headline; the first H200 run ran it on servers of its own)
#   errors       how the stock server refuses bad requests (vllm_errors.py; the simulator's fixtures)
#   kernels      the GPU kernel tests (pytest -m gpu, TRITON_INTERPRET=0)
# Each row: `bench mixed` with the same seed (the same schedule), DURATION s of steady load
# after BASELINE s of the users alone. Results accumulate in WORK; OUT gets mixed.tar.gz,
# the merged mixed.json / mixed.png and the table, each call.
set -u
OUT=${1:-out/mixed}
MODEL=${MODEL:-.gpu/model-qwen3-8b}
UTIL=${UTIL:-0.2}
KV_BYTES=${KV_BYTES:-17179869184}  # 16 GiB each: 12 users + several 20k prompts at once
DURATION=${DURATION:-60}
BASELINE=${BASELINE:-20}
SEED=${SEED:-0}
TIME_SCALE=${TIME_SCALE:-1}
ROWS=${ROWS:-direct hold slice-on slice-auto paced paced-short loop frontier}
GRAPH_SLICE=${GRAPH_SLICE:-480}
SPARSE_ARGS=${SPARSE_ARGS:---users 3 --think 2}
case " $ROWS " in *" paced"*|*" loop "*|*" frontier "*) PACED_SERVER=${PACED_SERVER:-1} ;; esac
PACED_SERVER=${PACED_SERVER:-0}  # the paced vLLM server, only when a row needs it
WORK=${WORK:-$OUT}
RUNS=1
mkdir -p "$OUT" "$WORK/res"
RES=$(cd "$WORK/res" && pwd)
source bench/gpu/lib.sh
STOCK=8001 PACED=8002 PACED0=8003  # PACED0: the dry run's paced simulator without short-first
WAIT=$(python3 -c "print(30 * $TIME_SCALE)")  # the proxy's max_queue_wait, in the engine's time

up() { curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1; }

start_servers() {
  if up $STOCK; then say "servers already up"; return; fi
  gpu_info
  echo "PREFILL_GATE_PACING=adaptive
PREFILL_GATE_PACING_TARGET_ITL_MS=15
PREFILL_GATE_PACING_CAP_TOKENS=256" > "$RES/control-paced.env"
  if [ "${DRY_RUN:-0}" = 1 ]; then
    start_server stock $STOCK --time-scale "$TIME_SCALE"
    start_server paced $PACED --time-scale "$TIME_SCALE" --pacing-cap 256
    start_server paced0 $PACED0 --time-scale "$TIME_SCALE" --pacing-cap 256 --pacing-short-tokens 0
  else
    start_server stock $STOCK --max-num-batched-tokens 8192 --enable-prompt-tokens-details
    if [ "$PACED_SERVER" = 1 ]; then
      sleep 12
      PREFILL_GATE_PACING_LOG_INTERVAL_S=5 PREFILL_GATE_PACING_CONTROL_FILE=$RES/control-paced.env \
        start_server paced $PACED --max-num-batched-tokens 8192 --enable-prompt-tokens-details \
        --scheduler-cls prefill_gate.engine_patches.pacing.PacedAsyncScheduler --compilation-config '{"cudagraph_mode":"FULL"}'
    fi
  fi
  local ports=$STOCK; [ "$PACED_SERVER" = 1 ] || [ "${DRY_RUN:-0}" = 1 ] && ports="$STOCK $PACED"
  for port in $ports; do
    wait_health $port 420 || { say "server on :$port did not come up"; tail -30 "$RES"/server-*.log; exit 1; }
  done
  say "servers healthy"
}

short_first() {  # on|off: the paced vLLM server's short-first rule, through its control file
  [ "${DRY_RUN:-0}" = 1 ] && return
  local n=1024; [ "$1" = off ] && n=0
  printf 'PREFILL_GATE_PACING=adaptive\nPREFILL_GATE_PACING_TARGET_ITL_MS=15\nPREFILL_GATE_PACING_CAP_TOKENS=256\nPREFILL_GATE_PACING_SHORT_TOKENS=%s\n' \
    "$n" > "$RES/control-paced.env.tmp" && mv "$RES/control-paced.env.tmp" "$RES/control-paced.env"
  sleep 1
}

row() {
  case $1 in
    direct) bench_mixed direct http://127.0.0.1:$STOCK ;;
    hold) proxy_up 8090 $STOCK && bench_mixed hold http://127.0.0.1:8090; proxy_down 8090 ;;
    slice-on) proxy_up 8091 $STOCK --slicing on && bench_mixed slice-on http://127.0.0.1:8091; proxy_down 8091 ;;
    slice-auto) proxy_up 8092 $STOCK --slicing auto --log-level info && bench_mixed slice-auto http://127.0.0.1:8092
      proxy_down 8092 ;;
    slice-auto-45) proxy_up 8099 $STOCK --slicing auto --slice-gap-ms 45 --log-level info \
      && bench_mixed slice-auto-45 http://127.0.0.1:8099; proxy_down 8099 ;;
    slice-pipe) proxy_up 8089 $STOCK --slicing auto --slice-inflight 2 --log-level info \
      && bench_mixed slice-pipe http://127.0.0.1:8089; proxy_down 8089 ;;
    slice-graph) proxy_up 8088 $STOCK --slicing auto --slice-inflight 2 --min-slice-tokens $GRAPH_SLICE \
      --max-slice-tokens $GRAPH_SLICE --log-level info && bench_mixed slice-graph http://127.0.0.1:8088; proxy_down 8088 ;;
    slice-idle) proxy_up 8095 $STOCK --slicing auto --slice-when-idle && bench_mixed slice-idle http://127.0.0.1:8095
      proxy_down 8095 ;;
    sparse-auto) proxy_up 8096 $STOCK --slicing auto && bench_mixed sparse-auto http://127.0.0.1:8096 $SPARSE_ARGS
      proxy_down 8096 ;;
    sparse-idle) proxy_up 8097 $STOCK --slicing auto --slice-when-idle \
      && bench_mixed sparse-idle http://127.0.0.1:8097 $SPARSE_ARGS; proxy_down 8097 ;;
    pair-auto) proxy_up 8094 $STOCK --slicing auto --log-level info && bench pair-auto http://127.0.0.1:8094
      grep -h "large prefill #" "$RES/proxy-8094.log" > "$RES/pair-auto-choices.log"; proxy_down 8094 ;;
    pair-headline) RUNS=3 bench pair-direct-3 http://127.0.0.1:$STOCK
      proxy_up 8098 $STOCK && RUNS=3 bench pair-proxy-3 http://127.0.0.1:8098; proxy_down 8098 ;;
    errors) say "vLLM's refusals"; python3 bench/gpu/vllm_errors.py --base-url http://127.0.0.1:$STOCK --model m \
      --json "$RES/vllm-errors.json" > "$RES/vllm-errors.txt" 2>&1; cat "$RES/vllm-errors.txt" ;;
    kernels) say "GPU kernel tests"; TRITON_INTERPRET=0 python3 -m pytest -v -m gpu -rs --noconftest -p no:cacheprovider \
      tests/kernel_tests/test_paged_attention.py > "$RES/kernel-tests.txt" 2>&1; tail -5 "$RES/kernel-tests.txt" ;;
    paced)
      if [ "${DRY_RUN:-0}" = 1 ]; then bench_mixed paced http://127.0.0.1:$PACED0
      else short_first off; bench_mixed paced http://127.0.0.1:$PACED; fi ;;
    paced-short) short_first on; bench_mixed paced-short http://127.0.0.1:$PACED ;;
    loop) short_first on; proxy_up 8093 $PACED --itl-slo-ms 20 && bench_mixed loop http://127.0.0.1:8093; proxy_down 8093 ;;
    frontier)
      for size in 256 512 1024; do
        proxy_up 8094 $STOCK --slicing on --min-slice-tokens $size --max-slice-tokens $size \
          && bench "pair-slice-$size" http://127.0.0.1:8094
        proxy_down 8094
      done
      proxy_up 8094 $STOCK --slicing on && bench pair-slice-feedback http://127.0.0.1:8094; proxy_down 8094
      proxy_up 8094 $STOCK && bench pair-hold http://127.0.0.1:8094; proxy_down 8094
      bench pair-direct http://127.0.0.1:$STOCK
      if [ "${DRY_RUN:-0}" = 1 ]; then bench pair-paced http://127.0.0.1:$PACED0
      else short_first off; bench pair-paced http://127.0.0.1:$PACED; fi
      short_first on; bench pair-paced-short http://127.0.0.1:$PACED ;;
    *) say "unknown row $1" ;;
  esac
}

[ "${KEEP:-1}" = 1 ] || trap cleanup EXIT
start_servers
for r in $ROWS; do row "$r"; done

mixed_report "$OUT"  # the sparse rows (fewer users) are merged apart
grep -h "prefill-gate pacing" "$RES"/server-paced.log 2>/dev/null | tail -20 > "$RES/pacing-decisions.log"
tar czf "$OUT/mixed.tar.gz" -C "$RES" --exclude='server-*.log' . 2>/dev/null
tail -c 2000000 "$RES"/server-stock.log > "$OUT/server-stock-tail.log" 2>/dev/null
say "done"

#!/usr/bin/env bash
# The starvation report's model class on one H200 (issue 25): a 27B dense hybrid (Gated
# DeltaNet + attention, `bench/gpu/hybrid_model.py`) with prefix caching in align mode, and
# the runs vLLM's maintainers asked for, as the seed pair (B streaming, A 28,600 tokens).
# Two servers share the GPU per phase (a 27B server starts in ~2 minutes; a device call is 10).
#
#   PHASE=a  :8001 --max-num-batched-tokens 2048 (the report's budget; align block 1568)
#            :8002 --max-num-batched-tokens 1568 (the align floor)
#            rows: each direct; through prefill-gate holding (defaults) and slicing (on) -> :8001
#   PHASE=b  (one call) :8001 --max-num-batched-tokens 8192 (the H200 default) and :8002 1568
#            (the align floor), both direct; then :8001 is replaced by 2048 --max-num-seqs 1
#            (the serialised baseline the maintainers asked for). Prefix caching on in all three.
#   PHASE=c  (one call) :8001 2048 + prefix caching + the paced scheduler; :8002 2048, no
#            prefix caching; rows: both direct, then on :8001 holding, slicing, pacing cap 1568
#            and adaptive 60 ms
#   PHASE=mixed  steady load (`bench mixed`, MIXED_ARGS: 8 users, a 20,000-token prompt every
#            ~10 s) on :8001 2048 and :8002 1568 (the align floor), prefix caching on both;
#            ROWS of: direct-2048 direct-1568 hold slice-auto slice-on (proxies -> :8001) and
#            clients (`vllm bench serve`, bench/clients/run.sh, against :8001 direct and
#            through holding and slicing). The servers stay up between calls of a warm machine
#            (results accumulate in WORK), so the rows can be split over calls.
# Every server: fp8 KV cache (the report's align block of 1568 tokens on one GPU: see
# hybrid_model.py), --language-model-only, --enable-prompt-tokens-details, --max-num-seqs 64
# (its 1,024 default exceeds the recurrent-state blocks of a 10 GiB cache: vLLM refuses), and
# --enable-prefix-caching where named (a hybrid model's default is off).
#
#   source .gpu/device_setup.sh setup && MODEL=.gpu/model-hybrid-27b PHASE=a bash bench/gpu/hybrid_h200.sh "$OUT"
# Here (simulators, no GPU): DRY_RUN=1 PHASE=a bash bench/gpu/hybrid_h200.sh out/hybrid-dry
set -u
OUT=${1:-out/hybrid}
MODEL=${MODEL:-.gpu/model-hybrid-27b}
PHASE=${PHASE:-a}
UTIL=${UTIL:-0.45}
KV_BYTES=${KV_BYTES:-10737418240}  # 10 GiB each: two 27B servers on one H200
RUNS=${RUNS:-1}
TIME_SCALE=${TIME_SCALE:-1}
WAIT=30
RES=$OUT/$PHASE
[ "$PHASE" = mixed ] && RES=${WORK:-$OUT}/mixed
mkdir -p "$RES" "$OUT"
DURATION=${DURATION:-90} BASELINE=${BASELINE:-15} SEED=${SEED:-0}
MIXED_ARGS=${MIXED_ARGS:---users 8 --long-every 10}
PROXY_LOG_LEVEL=info  # the proxy logs what slicing did
source bench/gpu/lib.sh
COMMON=(--language-model-only --kv-cache-dtype fp8 --enable-prompt-tokens-details --max-num-seqs 64
        --additional-config '{"gdn_prefill_backend": "triton"}')  # FlashInfer's GDN kernel is not staged
CACHE=--enable-prefix-caching NOCACHE=--no-enable-prefix-caching  # a hybrid model's default is off
if [ "${DRY_RUN:-0}" = 1 ]; then COMMON=(--preset "${SIM_PRESET:-h200-27b-hybrid}"); CACHE=; NOCACHE=--no-prefix-caching; fi

pacing() {  # the paced server's settings, through its control file
  printf '%s\n' "$@" > "$RES/control.env.tmp" && mv "$RES/control.env.tmp" "$RES/control.env"; sleep 1
}
servers_up() {
  for port in 8001 8002; do
    wait_health $port 480 "${PID_OF[s$port]}" || {
      say "server :$port did not come up"; tail -40 "$RES/server-s$port.log"; return 1; }
  done
  say "servers healthy"
  grep -h "block size\|align\|Mamba cache\|Padding mamba" "$RES"/server-*.log | sort -u | head -20 > "$RES/blocks.txt"
  cat "$RES/blocks.txt"
}

two_direct() {  # budget budget: :8001 and :8002 with prefix caching at those budgets, each benched direct
  start_server s8001 8001 "${COMMON[@]}" $CACHE --max-num-batched-tokens "$1"
  sleep 15
  start_server s8002 8002 "${COMMON[@]}" $CACHE --max-num-batched-tokens "$2"
  servers_up || exit 1
  bench "direct-$1" http://127.0.0.1:8001
  bench "direct-$2" http://127.0.0.1:8002
}

mixed_row() {  # one PHASE=mixed row
  case $1 in
    direct-2048) bench_mixed direct-2048 http://127.0.0.1:8001 $MIXED_ARGS ;;
    direct-1568) bench_mixed direct-1568 http://127.0.0.1:8002 $MIXED_ARGS ;;
    hold) proxy_up 8090 8001 && bench_mixed hold-2048 http://127.0.0.1:8090 $MIXED_ARGS; proxy_down 8090 ;;
    slice-auto) proxy_up 8092 8001 --slicing auto && bench_mixed slice-auto-2048 http://127.0.0.1:8092 $MIXED_ARGS
      proxy_down 8092 ;;
    slice-on) proxy_up 8091 8001 --slicing on && bench_mixed slice-on-2048 http://127.0.0.1:8091 $MIXED_ARGS
      proxy_down 8091 ;;
    clients) UPSTREAM=http://127.0.0.1:8001 MODEL_NAME=m TOKENIZER=$MODEL RATE=${CLIENT_RATE:-3} \
      LONG_RATE=${CLIENT_LONG_RATE:-0.1} DURATION=${CLIENT_DURATION:-60} GOODPUT="ttft:500 tpot:30" bash bench/clients/run.sh "$RES/clients" ;;
    *) say "unknown row $1" ;;
  esac
}

[ "$PHASE" = mixed ] || trap cleanup EXIT  # the mixed phase's servers outlive the call
gpu_info
case $PHASE in
  a)
    two_direct 2048 1568
    proxy_up 8090 8001 && bench hold-2048 http://127.0.0.1:8090; proxy_down 8090
    proxy_up 8091 8001 --slicing on && bench slice-2048 http://127.0.0.1:8091; proxy_down 8091 ;;
  b)  # one device call: the budgets around the report's, and the serialised baseline
    two_direct 8192 1568
    stop_server s8001
    start_server s8003 8001 "${COMMON[@]}" $CACHE --max-num-batched-tokens 2048 --max-num-seqs 1
    wait_health 8001 480 "${PID_OF[s8003]}" || { say "server :8001 (seqs 1) did not come up";
                                                  tail -40 "$RES/server-s8003.log"; exit 1; }
    bench direct-2048-seqs1 http://127.0.0.1:8001 ;;
  c)  # one device call: the report's budget with and without prefix caching, and everything
      # of ours on the first (pacing off there is stock vLLM at 2048)
    pacing PREFILL_GATE_PACING=off
    PREFILL_GATE_PACING_CONTROL_FILE=$RES/control.env PREFILL_GATE_PACING_LOG_INTERVAL_S=5 \
      start_server s8001 8001 "${COMMON[@]}" $CACHE --max-num-batched-tokens 2048 \
      --scheduler-cls prefill_gate.engine_patches.pacing.PacedAsyncScheduler
    sleep 15
    start_server s8002 8002 "${COMMON[@]}" --max-num-batched-tokens 2048 $NOCACHE
    servers_up || exit 1
    bench direct-2048 http://127.0.0.1:8001
    bench direct-2048-nocache http://127.0.0.1:8002
    proxy_up 8090 8001 && bench hold-2048 http://127.0.0.1:8090; proxy_down 8090
    proxy_up 8091 8001 --slicing on && bench slice-2048 http://127.0.0.1:8091; proxy_down 8091
    pacing PREFILL_GATE_PACING=cap PREFILL_GATE_PACING_CAP_TOKENS=1568
    bench paced-cap-1568 http://127.0.0.1:8001
    pacing PREFILL_GATE_PACING=adaptive PREFILL_GATE_PACING_TARGET_ITL_MS=60 PREFILL_GATE_PACING_CAP_TOKENS=1568
    bench paced-adaptive-60 http://127.0.0.1:8001
    grep -h "prefill-gate pacing" "$RES/server-s8001.log" | tail -20 > "$RES/pacing-decisions.log" ;;
  mixed)
    if ! curl -sf http://127.0.0.1:8001/health >/dev/null 2>&1; then
      start_server s8001 8001 "${COMMON[@]}" $CACHE --max-num-batched-tokens 2048
      sleep 15
      start_server s8002 8002 "${COMMON[@]}" $CACHE --max-num-batched-tokens 1568
      servers_up || exit 1
    fi
    for r in ${ROWS:-direct-2048 direct-1568 hold slice-auto slice-on}; do mixed_row "$r"; done
    mixed_report "$OUT" ;;
  *) say "PHASE must be a, b, c or mixed"; exit 2 ;;
esac
for s in s8001 s8002 s8003; do tail -c 300000 "$RES/server-$s.log" > "$RES/server-$s-tail.log" 2>/dev/null; done
: # the tables are in $RES/bench.log
tar czf "$OUT/hybrid-$PHASE.tar.gz" -C "$(dirname "$RES")" --exclude="server-s800?.log" "$PHASE"
say "done"

#!/usr/bin/env bash
# Issue 50, item 2: engine_patches.gdn (PREFILL_GATE_GDN_RECURRENT) against vLLM's own GDN path on
# the H200, in calls that resume (servers outlive a call, rows in WORK are skipped, DEADLINE: no
# new row past it). Run at ef1b4e3: bench/results/gdn/h200/ (the limit 512 came from the sweep).
#
#   STAGE=kernel   no model: the GPU tests (kernel against the specification, one mixed step of a
#                  27B-sized layer through vLLM's core and ours, our convolution's bits against
#                  vLLM's, nothing compiled after the warm-up), bench/gpu/gdn_conv_time.py (the
#                  convolution's host work, vLLM's and ours, at 300 and 16 prompt tokens) and
#                  bench/gpu/gdn_sweep.py (each path's time per layer call by prompt length: where
#                  the limit should be). ~3 min
#   STAGE=hybrid   the 27B hybrid (bench/gpu/hybrid_model.py) twice as the stack runs it (paced
#                  scheduler, graphs auto, prefix caching, fp8 KV, budget 2,048): :8001 without the
#                  patch, :8002 with PREFILL_GATE_GDN_RECURRENT=${GDN_LIMIT:-on} and
#                  PREFILL_GATE_GDN_CHUNK=${GDN_CHUNK:-off} and PREFILL_GATE_GDN_WALK=${GDN_WALK:-off}
#                  (rows labelled ours-gdn-cN, ours-gdn-wRxW); rows: greedy answers
#                  compared, `bench short` with pacing off and with adaptive 15 ms, the seed pair
#   STAGE=subblock the same two servers (started if not up): PREFILL_GATE_PACING_SUB_BLOCK's GPU
#                  check on each (bench/gpu/sub_block_compare.py: the same prompts paced in whole
#                  blocks and below them, next to a stream; answers, a prefix-cache hit, B's gaps)
#
#   source .gpu/device_setup.sh setup && STAGE=kernel bash bench/gpu/gdn_h200.sh "$OUT"
#   source .gpu/device_setup.sh setup && STAGE=hybrid DEADLINE=420 bash bench/gpu/gdn_h200.sh "$OUT"
#   (with none of GDN_LIMIT, GDN_CHUNK, GDN_WALK set, a kernel stage run before in the same WORK chooses them)
set -u
OUT=${1:-out/gdn}
STAGE=${STAGE:-kernel}
WORK=${WORK:-/root/gdn}
RUNS=${PAIR_RUNS:-3}
SHORT_DURATION=${SHORT_DURATION:-45}
mkdir -p "$OUT" "$WORK/$STAGE" "$WORK/hybrid"
RES=$(cd "$WORK/$STAGE" && pwd)
HYB=$(cd "$WORK/hybrid" && pwd)  # the hybrid servers' pacing control file, shared by their stages
MODEL=${MODEL:-.gpu/model-hybrid-27b} UTIL=${UTIL:-0.45} KV_BYTES=${KV_BYTES:-10737418240}
source bench/gpu/lib.sh
[ -f .gpu/ep/prefill_gate-0.1.0.dist-info/entry_points.txt ] || { say "no .gpu/ep (bench/gpu/dist_info.py)"; exit 2; }
export PYTHONPATH=$PYTHONPATH:$PWD/.gpu/ep:$PWD
up() { curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1; }
deadline_passed() { [ "${DEADLINE:-0}" -gt 0 ] && [ $(( $(date +%s) - t0 )) -ge "$DEADLINE" ]; }
PACED_CLS=prefill_gate.engine_patches.pacing.PacedAsyncScheduler
[ "$STAGE" != kernel ] && gdn_choice "$WORK/kernel/sweep.json"
OURS=ours-gdn${GDN_CHUNK:+-c$GDN_CHUNK}${GDN_WALK:+-w$GDN_WALK}  # the patched server's rows: with chunks or a walk
# of their own, not to be taken for the default token walk's

pacing() {  # KEY=VALUE...: both servers' pacing settings, through their control file
  printf '%s\n' "$@" > "$HYB/control.env.tmp" && mv "$HYB/control.env.tmp" "$HYB/control.env"; sleep 1
}

row() {  # kind label url: one resumable row (short | pair | greedy)
  local kind=$1 label=$2 url=$3
  if [ -f "$RES/$kind-$label.json" ]; then say "$kind $label: done already"; return 0; fi
  if deadline_passed; then say "$kind $label: left for the next call (DEADLINE)"; return 0; fi
  say "$kind $label -> $url"
  case $kind in
    short) python3 -m prefill_gate bench short --base-url "$url" --model m --label "$label" \
             --duration "$SHORT_DURATION" --json "$RES/short-$label.json" 2>&1 | grep -v '^\[short\]' ;;
    pair) python3 -m prefill_gate bench overlap --base-url "$url" --model m --runs "$RUNS" --label "$label" \
            --json "$RES/pair-$label.json" --plot "$RES/pair-$label.png" 2>&1 | grep -v '^\[overlap\]' ;;
    greedy) python3 bench/gpu/greedy_compare.py http://127.0.0.1:8001 "$url" --json "$RES/greedy-$label.json" ;;
    subblock) python3 bench/gpu/sub_block_compare.py "$url" --control "$HYB/control.env" \
                --json "$RES/subblock-$label.json" ;;
  esac | tee -a "$RES/bench.log"
}

gpu_info
case $STAGE in
  kernel)
    # --noconftest: the suite's conftest imports the proxy's test fixtures; the GPU tests need none
    TRITON_INTERPRET=0 python3 -m pytest -v -rs --noconftest -p no:cacheprovider -m gpu \
      tests/kernel_tests/test_gated_delta.py tests/kernel_tests/test_causal_conv.py tests/engine/test_gdn.py \
      tests/engine/test_gdn_graph.py tests/engine/test_warmup.py > "$RES/gpu-tests.txt" 2>&1
    tail -8 "$RES/gpu-tests.txt"
    for n in 300 16; do  # our convolution against vLLM's: one call's host work, the GPU's, the bits
      [ -f "$RES/conv-time-$n.json" ] || TRITON_INTERPRET=0 python3 bench/gpu/gdn_conv_time.py --prompt "$n" \
        --json "$RES/conv-time-$n.json" 2>&1 | tee "$RES/conv-time-$n.txt"
    done
    [ -f "$RES/sweep.json" ] || TRITON_INTERPRET=0 python3 bench/gpu/gdn_sweep.py --json "$RES/sweep.json" \
      --shapes "${SHAPES:-32x1,32x1x0x1,w32x1,w16x1,w8x1,w4x1,w8x2,w16x2,16x1x16x8,16x1x32x8}" \
      2>&1 | tee "$RES/sweep.txt" ;;
  hybrid|subblock)
    SERVING="gdn $MODEL limit=${GDN_LIMIT:-on} chunk=${GDN_CHUNK:-off} walk=${GDN_WALK:-off}"
    keep_only_servers_of "$SERVING" 8001 8002
    if ! { up 8001 && up 8002; }; then
      echo "$SERVING" > "$SERVERS_MARK"
      COMMON=(--language-model-only --kv-cache-dtype fp8 --enable-prompt-tokens-details --max-num-seqs 64
              --additional-config '{"gdn_prefill_backend": "triton"}' --enable-prefix-caching
              --max-num-batched-tokens 2048 --scheduler-cls "$PACED_CLS")
      pacing PREFILL_GATE_PACING=off
      export PREFILL_GATE_PACING_CONTROL_FILE=$HYB/control.env PREFILL_GATE_PACING_LOG_INTERVAL_S=10
      PREFILL_GATE_GDN_RECURRENT=off start_server vllm-gdn 8001 "${COMMON[@]}"
      sleep 15
      PREFILL_GATE_GDN_CHUNK=${GDN_CHUNK:-off} PREFILL_GATE_GDN_WALK=${GDN_WALK:-off} \
        PREFILL_GATE_GDN_RECURRENT=${GDN_LIMIT:-on} start_server ours-gdn 8002 "${COMMON[@]}"
      for s in vllm-gdn:8001 ours-gdn:8002; do
        wait_health "${s#*:}" 480 "${PID_OF[${s%:*}]}" || { say "${s%:*} did not come up"; tail -40 "$RES/server-${s%:*}.log"; exit 1; }
      done
      say "servers healthy"
    fi
    grep -h "prefill-gate" "$RES"/server-*.log "$HYB"/server-*.log 2>/dev/null | grep -i "gated deltanet\|CUDA graphs" \
      | sort -u | tee "$RES/patches.txt"
    if [ "$STAGE" = subblock ]; then
      row subblock vllm-gdn http://127.0.0.1:8001
      row subblock $OURS http://127.0.0.1:8002
      pack_results "gdn-$STAGE"; exit 0
    fi
    pacing PREFILL_GATE_PACING=off
    row greedy $OURS http://127.0.0.1:8002
    row short vllm-gdn http://127.0.0.1:8001
    row short $OURS http://127.0.0.1:8002
    pacing PREFILL_GATE_PACING=adaptive PREFILL_GATE_PACING_TARGET_ITL_MS=15
    row short paced-vllm-gdn http://127.0.0.1:8001
    row short paced-$OURS http://127.0.0.1:8002
    row pair paced-$OURS http://127.0.0.1:8002
    row pair paced-vllm-gdn http://127.0.0.1:8001 ;;
  *) say "STAGE must be kernel, hybrid or subblock"; exit 2 ;;
esac
pack_results "gdn-$STAGE"

#!/usr/bin/env bash
# What the defaults give on real vLLM 0.26.0: `prefill-gate bench defaults` (vLLM direct, the
# proxy holding, the proxy with no flags, the stack: the proxy with no flags in front of a vLLM
# that paces its steps), on the seed pair, sparse users and steady load, in calls that resume.
#
# On the GPU machine, after the recipe's chunk-only first run (docs/results/defaults.md):
#   source .gpu/device_setup.sh setup && DEADLINE=370 bash bench/gpu/defaults_h200.sh "$OUT"
#   (each next call, servers still up: the same command; what is done is skipped)
# Here, against two simulators (the paced one paces like the patches' cap mode):
#   DRY_RUN=1 bash bench/gpu/defaults_h200.sh out/defaults-sim
#
# Two vLLM servers, started once with setsid (they outlive the call; stock only where ROWS uses it):
#   stock  --max-num-batched-tokens 8192 --enable-prompt-tokens-details
#   paced  the same + the engine patches as docker compose starts them: PacedAsyncScheduler,
#          PREFILL_GATE_PACING=adaptive, 15 ms target, short prompts first, full CUDA graphs
#          (vLLM's own capture sizes, up to 512 tokens: engine_patches.graphs adds none at
#          --max-num-seqs 256; the stack row of run ee9ed4e had graphs up to 8192, see its README)
# Each part's JSON accumulates in WORK (/root/defaults on the device, outside the tree); each
# call leaves OUT/defaults.json (every part so far, the checks), .png, -table.txt and the logs.
# ROWS, PARTS: what to run (default: every row, every part); PAIR_FRESH=1: each pair run through a
# new proxy (rows with one), every run the first long prompt a proxy slices.
# DEADLINE: seconds after this script starts past which no new part starts (a part runs to its
# end, a steady part ~3 minutes; the device kills a call at 600 s); 0: no limit.
#
# PACED_EXTRA_ENV: more engine-patch settings for the paced server only (e.g.
# PREFILL_GATE_PACING_SHORT_WHEN_IDLE=1, with WORK elsewhere: its parts are another stack's).
#
# CLASS=hybrid: the report's model class instead (issue 50): the 27B Gated DeltaNet hybrid
# (.gpu/model-hybrid-27b) as bench/gpu/gdn_h200.sh serves it (fp8 KV, prefix caching in align
# mode, --max-num-batched-tokens 2048, --max-num-seqs 64, Triton GDN prefill, vLLM's own
# compilation config), rows direct and stack, parts short, pair and steady (8 users, a 20k prompt
# every ~10 s, 90 s), judged by `--checks hybrid`. The paced server as the stack would run it on
# that class: adaptive pacing at TARGET_MS, below the align block (SUB_BLOCK=1), the GDN path
# (GDN_LIMIT, default on; GDN_CHUNK, default off; GDN_WALK, default 8x1 as the stack ships it; or all three from gdn_h200.sh's kernel stage,
# `python3 bench/gpu/gdn_sweep.py --choice --json .../sweep.json`). TARGET_MS 44, from the H200's
# numbers: a step there was first estimated at ~22 ms of decode and host floor plus ~0.1 ms a prompt
# token with chunks (0.18 token by token), so a step of T ms carries (T - 22) / 0.1 tokens and the
# seed pair's A (28.6k tokens, 3.0 s alone) takes ~2.9 s x T / (T - 22): within 2x alone from
# T ~ 42 ms, while B's worst gap (~T) stays under 50. Measured since with the GDN path on
# (bench/results/gdn/h200/short-ours-gdn.json): ~15 ms plus 0.09-0.11 ms a prompt token token by
# token (the prompts' TTFT slope), so at T = 44 a step carries ~320 tokens and A takes ~1.3x alone
# (the simulator's h200-27b-hybrid-stack preset, which the dry run paces at 320 tokens).
#   source .gpu/device_setup.sh setup && CLASS=hybrid DEADLINE=400 bash bench/gpu/defaults_h200.sh "$OUT"
#   (GDN_CHUNK, GDN_LIMIT and GDN_WALK from GDN_SWEEP, default /root/gdn/kernel/sweep.json, unless set)
#   On a card under 120 GiB (an H100) one 27B server at a time (ONE_SERVER, below): ROWS=direct, then ROWS=stack.
#   SUBBLOCK=1: after the rows, sub-block pacing's answers on the paced server (below).
#   GREEDY_SAVE=FILE, GREEDY_AGAINST=FILE: after the rows, the paced server's greedy answers saved, or
#   compared with saved ones (below). GDN_GRAPH (default on, as the stack ships it): whole graphs
#   for mixed steps (the server then runs cudagraph_mode FULL); GDN_GRAPH=off, with WORK
#   elsewhere: the stack without them.
#   PROFILE=1: the paced server armed with vLLM's torch profiler, and after the rows a profile of
#   short prompts beside 4 streams on it, summarised per step (below).
#   CONTROL='KEY=VALUE ...' (ROWS=stack): the parts on the running paced server with these engine-patch
#   settings layered over its own through its control file (e.g. PREFILL_GATE_PACING_TARGET_ITL_MS=40,
#   or the GDN patch's: PREFILL_GATE_FAST_LAUNCH=on, PREFILL_GATE_GDN_RECURRENT=off for vLLM's path),
#   no restart; their parts in WORK/variant-VARIANT (VARIANT: a name, default from CONTROL), OUT as
#   usual; the server gets its own settings back after. Keep WORK: another WORK restarts the servers
#   (TRACE: the running server's, unless set).
set -u
OUT=${1:-out/defaults}
CLASS=${CLASS:-dense}
source bench/gpu/lib.sh  # (its functions read RES and the rest when called, below)
case $CLASS in
  dense)
    UTIL_80GB=0.45  # the 8B's two servers on an 80 GB H100 (run b953a47); 0.2 each on the H200
    [ "${DRY_RUN:-0}" != 1 ] && small_card && UTIL=${UTIL:-$UTIL_80GB}
    MODEL=${MODEL:-.gpu/model-qwen3-8b} UTIL=${UTIL:-0.2} KV_BYTES=${KV_BYTES:-17179869184}
    ROWS=${ROWS:-direct,proxy,stack,hold} PARTS=${PARTS:-pair,sparse,steady} WORK=${WORK:-/root/defaults}
    DURATION=${DURATION:-120} CHECKS=defaults USERS=12 LONG_EVERY=4
    ENGINE_ARGS=(--max-num-batched-tokens 8192 --enable-prompt-tokens-details)
    PACED_ENV=(PREFILL_GATE_PACING_TARGET_ITL_MS=15 ${PACED_EXTRA_ENV:-})  # e.g. PREFILL_GATE_PACING_SHORT_WHEN_IDLE=1
    PACED_ARGS=(--compilation-config '{"cudagraph_mode":"FULL"}')
    SIM_ARGS=() SIM_PACED_ARGS=(--pacing-cap 256)
    [[ "${PACED_EXTRA_ENV:-}" == *SHORT_WHEN_IDLE=1* ]] && SIM_PACED_ARGS+=(--pacing-short-when-idle) ;;
  hybrid)
    gdn_choice "${GDN_SWEEP:-/root/gdn/kernel/sweep.json}"  # gdn_h200.sh's kernel stage, unless set here
    MODEL=${MODEL:-.gpu/model-hybrid-27b} UTIL=${UTIL:-0.45} KV_BYTES=${KV_BYTES:-10737418240}
    ROWS=${ROWS:-direct,stack} PARTS=${PARTS:-short,pair,steady} WORK=${WORK:-/root/hybrid-stack}
    DURATION=${DURATION:-90} CHECKS=hybrid USERS=8 LONG_EVERY=10
    ENGINE_ARGS=(--language-model-only --kv-cache-dtype fp8 --enable-prompt-tokens-details --max-num-seqs 64
                 --additional-config '{"gdn_prefill_backend": "triton"}' --enable-prefix-caching
                 --max-num-batched-tokens 2048)
    [ "${GDN_LIMIT:-on}" = off ] && GDN_GRAPH=${GDN_GRAPH:-off}  # the graphs replay the recurrence: off without it
    PACED_ENV=(PREFILL_GATE_PACING_TARGET_ITL_MS=${TARGET_MS:-44} PREFILL_GATE_PACING_SUB_BLOCK=${SUB_BLOCK:-1}
               PREFILL_GATE_GDN_RECURRENT=${GDN_LIMIT:-on} PREFILL_GATE_GDN_CHUNK=${GDN_CHUNK:-off}
               PREFILL_GATE_GDN_WALK=${GDN_WALK:-8x1} PREFILL_GATE_GDN_GRAPH=${GDN_GRAPH:-on} ${PACED_EXTRA_ENV:-})
    PACED_ARGS=()
    # PREFILL_GATE_GDN_GRAPH=on (engine_patches.gdn_graph, the stack's default since run-27395ae;
    # GDN_GRAPH=off: vLLM's own graph mode, as the stack ran before): whole graphs for mixed
    # steps, which vLLM builds only with cudagraph_mode FULL (pieces for mixed steps otherwise).
    # The last setting wins, PACED_EXTRA_ENV's included.
    graph_setting=$(printf '%s\n' "${PACED_ENV[@]}" | grep '^PREFILL_GATE_GDN_GRAPH=' | tail -1)
    [ "$graph_setting" = PREFILL_GATE_GDN_GRAPH=on ] && PACED_ARGS=(--compilation-config '{"cudagraph_mode":"FULL"}')
    # the paced simulator as the stack: graphs to 512 and the GDN path (its own preset), steps of the
    # 320 tokens its model fits in 44 ms (14.1 + 1 + 0.09 a token), as adaptive pacing at TARGET_MS would
    SIM_ARGS=(--preset h200-27b-hybrid) SIM_PACED_ARGS=(--preset h200-27b-hybrid-stack --pacing-cap 320 --pacing-sub-block) ;;
  *) echo "CLASS must be dense or hybrid" >&2; exit 2 ;;
esac
[ "${DRY_RUN:-0}" = 1 ] && WORK=${WORK_DRY:-$OUT/work}
BASELINE=${BASELINE:-20}
SPARSE_DURATION=${SPARSE_DURATION:-60}
PAIR_RUNS=${PAIR_RUNS:-3}
FRESH=""; [ "${PAIR_FRESH:-0}" = 1 ] && FRESH=--pair-fresh-proxy  # each pair run through a new proxy
mkdir -p "$OUT" "$WORK"
RES=$(cd "$WORK" && pwd)
# The host's own speed beside the run, every 0.2 s (bench/gpu/host_probe.py, ~1 ms of one core a
# sample): a step that ran long while the probe's fixed work ran slow too was the machine's, not
# the engine's (`place_stalls.py --probe WORK/host-probe.jsonl`; in the parts tarball).
RESET_CONTROL=0
python3 bench/gpu/host_probe.py "$RES/host-probe.jsonl" --every 0.2 &
PROBE_PID=$!
# And the card's: SM clock, power, temperature and NVML's reasons for holding the clocks, every
# 0.2 s (bench/gpu/gpu_probe.py; `--pairs` sets them beside each seed-pair run's long prompt).
GPU_PROBE_PID=""
if [ "${DRY_RUN:-0}" != 1 ]; then python3 bench/gpu/gpu_probe.py "$RES/gpu-probe.jsonl" --every 0.2 & GPU_PROBE_PID=$!; fi
cleanup() {
  kill "$PROBE_PID" $GPU_PROBE_PID 2>/dev/null
  [ "$RESET_CONTROL" = 1 ] && : > "$CONTROL_FILE"  # the server's own settings back, however this ends
}
trap cleanup EXIT
RUNS=1
STOCK=${STOCK_PORT:-8001} PACED=${PACED_PORT:-8002}
# Not pip-installed there: the engine patches' entry points (the plugin, and the stat logger
# that publishes prefill_gate_engine_info) come from the wheel's dist-info, shipped as .gpu/ep
# (`python3 bench/gpu/dist_info.py .gpu/ep` writes it). Without them the proxy cannot see the pacing.
if [ "${DRY_RUN:-0}" != 1 ]; then
  [ -f .gpu/ep/prefill_gate-0.1.0.dist-info/entry_points.txt ] \
    || { say "no .gpu/ep/prefill_gate-0.1.0.dist-info: the paced server would publish no engine info"; exit 2; }
  export PYTHONPATH=$PYTHONPATH:$PWD/.gpu/ep
fi

up() { curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1; }

# Both servers log their cycle collector's pauses past 20 ms (the plugin's watch; unset, only the
# paced one would): gc-pauses.log, below.
export PREFILL_GATE_GC_LOG_MS=${PREFILL_GATE_GC_LOG_MS:-20}
# TRACE=1: the paced server writes a JSON line a step (PREFILL_GATE_PACING_TRACE_FILE; its `unix`
# beside each phase's t0_unix + worst_gaps says whether a stall of every stream was a long step or
# came after the step); OUT gets it compressed. A diagnosis: a line written a step.
# A CONTROL call reuses the paced server that is up, so it takes that server's trace setting rather
# than restart it as another configuration (the trace then holds the variant's steps too).
if [ -n "${CONTROL:-}" ] && [ -z "${TRACE:-}" ] \
    && grep -qF "PREFILL_GATE_PACING_TRACE_FILE=$RES/paced-trace.jsonl" "$SERVERS_MARK" 2>/dev/null; then
  TRACE=1
fi
[ "${TRACE:-0}" = 1 ] && PACED_ENV+=(PREFILL_GATE_PACING_TRACE_FILE=$RES/paced-trace.jsonl)
# PROFILE=1: vLLM's torch profiler, armed on the paced server (it records only between
# /start_profile and /stop_profile; the server must start with it: the call that starts it, or a
# new WORK); bench/gpu/profile_steps.py drives it after the rows.
[ "${PROFILE:-0}" = 1 ] && PACED_ARGS+=(--profiler-config "{\"profiler\": \"torch\", \"torch_profiler_dir\": \"$RES/prof\", \"ignore_frontend\": true, \"torch_profiler_with_stack\": false}")
# CLASS=hybrid: a control file the paced server layers over PACED_ENV (absent or empty: PACED_ENV);
# SUBBLOCK=1 below checks sub-block pacing's answers on this same server, which then gets them back.
CONTROL_FILE=""
if [ "$CLASS" = hybrid ]; then CONTROL_FILE=$RES/control.env; PACED_ENV+=(PREFILL_GATE_PACING_CONTROL_FILE=$CONTROL_FILE); fi
# The stock server only for the rows that use it (ROWS=stack needs the paced one alone).
SERVERS=paced
case ",$ROWS," in *,direct,*|*,hold,*|*,proxy,*) SERVERS="stock paced" ;; esac
# ONE_SERVER=1: one vLLM at a time, for a card that cannot hold both (the 27B hybrid on an 80 GB
# H100: ~54 GB of weights a server). Each call then runs the rows of one server (ROWS=direct, then
# ROWS=stack, on the same machine: the parts accumulate in WORK as in one call) and stops the
# other server first. auto: on for CLASS=hybrid on a card under 120 GiB.
ONE_SERVER=${ONE_SERVER:-auto}
if [ "$ONE_SERVER" = auto ]; then
  ONE_SERVER=0
  [ "$CLASS" = hybrid ] && [ "${DRY_RUN:-0}" != 1 ] && small_card && ONE_SERVER=1
fi
if [ "$ONE_SERVER" = 1 ]; then
  case ",$ROWS," in
    *,stack,*) [ "$SERVERS" = paced ] \
      || { say "ONE_SERVER: this card holds one server at a time: the stock rows first (e.g. ROWS=direct), then ROWS=stack"; exit 2; } ;;
    *) SERVERS=stock ;;
  esac
  say "one server at a time (ONE_SERVER=1): $SERVERS"
fi
port_of() { [ "$1" = stock ] && echo $STOCK || echo $PACED; }
# Servers outlive a call, so the ones up may be another CLASS's, MODEL's or script's: stopped.
SERVING="defaults $CLASS $MODEL ${PACED_ENV[*]} dry=${DRY_RUN:-0}"
keep_only_servers_of "$SERVING" $STOCK $PACED
if [ "$ONE_SERVER" = 1 ]; then
  for name in stock paced; do
    case " $SERVERS " in *" $name "*) ;; *) stop_port "$(port_of $name)" ;; esac
  done
fi
missing=""
for name in $SERVERS; do up "$(port_of $name)" || missing="$missing $name"; done
if [ -z "$missing" ]; then
  say "servers already up:$SERVERS"
else
  gpu_info
  for name in $missing; do
    if [ "${DRY_RUN:-0}" = 1 ]; then
      if [ $name = stock ]; then start_server stock $STOCK "${SIM_ARGS[@]}"; else start_server paced $PACED "${SIM_PACED_ARGS[@]}"; fi
    elif [ $name = stock ]; then
      start_server stock $STOCK "${ENGINE_ARGS[@]}"
      sleep 12  # the second start's memory profiling after the first's
    else
      # the engine patches' settings for this server only (a proxy started later must not see them)
      PACED_ENV+=(PREFILL_GATE_PACING=adaptive PREFILL_GATE_PACING_LOG_INTERVAL_S=10)
      for kv in "${PACED_ENV[@]}"; do export "$kv"; done
      start_server paced $PACED "${ENGINE_ARGS[@]}" \
        --scheduler-cls prefill_gate.engine_patches.pacing.PacedAsyncScheduler "${PACED_ARGS[@]}"
      for kv in "${PACED_ENV[@]}"; do unset "${kv%%=*}"; done
    fi
  done
  echo "$SERVING" > "$SERVERS_MARK"
  for name in $missing; do
    port=$(port_of $name)
    wait_health $port 420 "${PID_OF[$name]}" || { say "$name server did not come up"; tail -n 40 "$RES/server-$name.log"; exit 1; }
  done
  say "servers healthy"
  grep -h "prefill-gate CUDA graphs\|Graph capturing finished\|graph pool" "$RES"/server-*.log > "$RES/graphs.txt" 2>/dev/null
  cat "$RES/graphs.txt"
fi
# What the paced server publishes for the proxy (the engine patches' stat-logger plugin): the
# stack row means nothing without it (bench defaults checks the proxy saw it, too).
case " $SERVERS " in
  *" paced "*)
    curl -s "http://127.0.0.1:$PACED/metrics" | grep '^prefill_gate_engine_info' | tee "$RES/paced-engine-info.txt"
    grep -Eq 'pacing="(adaptive|cap)"' "$RES/paced-engine-info.txt" || { say "the paced server publishes no pacing"; exit 3; } ;;
esac

# A variant (CONTROL, PROXY_ARGS below): its parts in WORK/variant-VARIANT, named by default from
# both, so that parts done under other settings are not taken for its own.
BENCH_WORK=$RES
if [ -n "${CONTROL:-}${PROXY_ARGS:-}" ]; then
  name=${CONTROL:-}
  [ -n "${PROXY_ARGS:-}" ] && name="${name:+$name }proxy$PROXY_ARGS"
  VARIANT=${VARIANT:-$(printf '%s' "$name" | sed 's/PREFILL_GATE_//g; s/[^A-Za-z0-9.]\{1,\}/-/g')}
  BENCH_WORK=$RES/variant-$VARIANT
  mkdir -p "$BENCH_WORK"
fi
# CONTROL: the paced server's parts under other settings, through its control file (above).
if [ -n "${CONTROL:-}" ]; then
  [ -n "$CONTROL_FILE" ] || { say "CONTROL needs the paced server's control file (CLASS=hybrid)"; exit 2; }
  [ "$ROWS" = stack ] || { say "CONTROL changes the paced server only: ROWS=stack"; exit 2; }
  RESET_CONTROL=1  # cleanup() empties the control file, however this ends
  printf '%s\n' $CONTROL > "$CONTROL_FILE"
  # read as the server will (a file it refuses, it ignores: the parts would run on its own settings)
  settings=$(python3 - "$CONTROL_FILE" "${PACED_ENV[@]}" PREFILL_GATE_PACING=adaptive <<'PY'
import sys
from prefill_gate._env import read_settings_file
from prefill_gate.engine_patches import gdn
from prefill_gate.engine_patches.config import control_key, read_control_file
from prefill_gate.kernels import launch
env = dict(kv.split("=", 1) for kv in sys.argv[2:])
try:
    merged = {**env, **read_settings_file(sys.argv[1], control_key, ValueError)}
    gdn.mode_from_env(merged), gdn.chunk_from_env(merged), gdn.walk_from_env(merged), gdn.conv_from_env(merged)
    launch.enabled_from_env(merged)
    print(read_control_file(sys.argv[1], env).describe())
except ValueError as exc:
    print(exc)
    sys.exit(2)
PY
) || { say "CONTROL refused: $settings"; exit 2; }
  say "control: $CONTROL (parts in $BENCH_WORK): $settings"
fi

# PROXY_ARGS='--ARG=VALUE ...': more settings for every proxy the bench starts (e.g.
# '--slice-inflight-capped=2'), its parts in a variant folder (above); the servers keep running.
PROXY_ARG_FLAGS=()
if [ -n "${PROXY_ARGS:-}" ]; then
  for arg in $PROXY_ARGS; do PROXY_ARG_FLAGS+=("--proxy-arg=$arg"); done
  say "proxy settings: $PROXY_ARGS (parts in $BENCH_WORK)"
fi

BUDGET=0
if [ "${DEADLINE:-0}" -gt 0 ]; then
  BUDGET=$(( DEADLINE - ($(date +%s) - t0) ))
  [ "$BUDGET" -gt 0 ] || { say "no time left for a part before DEADLINE"; BUDGET=0.001; }
fi
say "bench defaults: $ROWS, $PARTS (parts start within $BUDGET s)"
python3 -m prefill_gate bench defaults --stock "http://127.0.0.1:$STOCK" --paced "http://127.0.0.1:$PACED" \
  --checks "$CHECKS" --users "$USERS" --long-every "$LONG_EVERY" \
  --model m --work "$BENCH_WORK" --rows "$ROWS" --parts "$PARTS" --duration "$DURATION" --baseline-duration "$BASELINE" \
  --sparse-duration "$SPARSE_DURATION" --short-duration "${SHORT_DURATION:-45}" --pair-runs "$PAIR_RUNS" $FRESH \
  --budget "$BUDGET" "${PROXY_ARG_FLAGS[@]}" \
  --json "$OUT/defaults.json" --plot "$OUT/defaults.png" 2>&1 | grep -v '^\[overlap\]' | tee "$OUT/defaults-table.txt"
# SUBBLOCK=1 (CLASS=hybrid): PREFILL_GATE_PACING_SUB_BLOCK's answers on the paced server, after the
# rows: the same prompts paced in whole blocks and below them next to a stream, and a prefix-cache
# hit after (bench/gpu/sub_block_compare.py; it leaves the control file empty, the server's own
# settings). On an H100, the only way: gdn_h200.sh's subblock stage wants two 27B servers.
if [ "${SUBBLOCK:-0}" = 1 ] && [ -n "$CONTROL_FILE" ] && [ "${DRY_RUN:-0}" != 1 ] && up $PACED; then
  say "sub-block pacing's answers on the paced server"
  python3 bench/gpu/sub_block_compare.py "http://127.0.0.1:$PACED" --control "$CONTROL_FILE" \
    --json "$RES/subblock.json" 2>&1 | tail -4
fi
# GREEDY_SAVE=FILE / GREEDY_AGAINST=FILE: the paced server's greedy answers to short prompts saved,
# or compared with answers saved before from another server (bench/gpu/greedy_compare.py: one 27B
# server at a time on an H100; e.g. PREFILL_GATE_GDN_GRAPH on against off); greedy.json beside.
if [ -n "${GREEDY_SAVE:-}${GREEDY_AGAINST:-}" ] && [ "${DRY_RUN:-0}" != 1 ] && up $PACED; then
  if [ -n "${GREEDY_SAVE:-}" ]; then
    python3 bench/gpu/greedy_compare.py "http://127.0.0.1:$PACED" --save "$GREEDY_SAVE" 2>&1 | tail -2
    cp "$GREEDY_SAVE" "$RES/greedy-answers.json" 2>/dev/null  # the answers themselves, in the parts tarball
  else
    python3 bench/gpu/greedy_compare.py "http://127.0.0.1:$PACED" --against "$GREEDY_AGAINST" \
      --json "$RES/greedy.json" 2>&1 | tail -2
  fi
fi
# PROFILE=1: per step of short prompts beside 4 streams, the host's time, the GDN cores' share of
# it, the GPU's busy time and the launches (issue 50's profile of the eager GDN path; profile.json
# in the parts tarball, the traces left in WORK/prof).
if [ "${PROFILE:-0}" = 1 ] && [ "${DRY_RUN:-0}" != 1 ] && up $PACED; then
  say "profiling short prompts beside 4 streams on the paced server"
  python3 bench/gpu/profile_steps.py collect "http://127.0.0.1:$PACED" --dir "$RES/prof" --json "$RES/profile.json" \
    2>&1 | tail -70
  # the trace itself beside its summary (in the parts tarball), for reading op by op here
  newest=$(find "$RES/prof" -name '*.pt.trace.json*' -printf '%T@ %p\n' 2>/dev/null | sort -n | tail -1 | cut -d' ' -f2-)
  if [ -n "$newest" ]; then case "$newest" in *.gz) cp "$newest" "$RES/profile-trace.json.gz" ;;
    *) gzip -c "$newest" > "$RES/profile-trace.json.gz" ;; esac; fi
fi
kill "$PROBE_PID" $GPU_PROBE_PID 2>/dev/null; wait "$PROBE_PID" $GPU_PROBE_PID 2>/dev/null
python3 bench/gpu/host_probe.py --summary "$RES/host-probe.jsonl" 2>&1 | grep -E '"(samples|work_us_p50|work_us_p90|work_us_max|slow_share|steal_max)"' | tr -d '\n '; echo
# Was the host quiet during each part (a run on a noisy host misses bounds that are not the engine's)?
[ -f "$OUT/defaults.json" ] && python3 bench/gpu/host_probe.py --parts "$RES/host-probe.jsonl" "$OUT/defaults.json"
if [ -s "$RES/gpu-probe.jsonl" ]; then
  python3 bench/gpu/gpu_probe.py --summary "$RES/gpu-probe.jsonl" | tr -d '\n '; echo
  [ -f "$OUT/defaults.json" ] && python3 bench/gpu/gpu_probe.py --pairs "$RES/gpu-probe.jsonl" "$OUT/defaults.json"
fi
# The servers' and proxies' lines worth keeping, as four logs in one tarball (defaults-logs.tar.gz):
# a device call brings back 8 files at most, and the step trace must be one of them.
LOGS=$RES/logs
rm -rf "$LOGS"; mkdir -p "$LOGS"
grep -h "large prefills are\|large prefill #" "$RES"/proxy-*.log 2>/dev/null | tail -200 > "$LOGS/proxy-decisions.log"
grep -h "prefill-gate" "$RES"/server-paced.log 2>/dev/null | grep -v "cycle collector" | tail -40 > "$LOGS/paced-server.log"
# Collections of Python's cycle collector past 20 ms in the servers (the plugin's watch) and the
# proxies, each with its wall-clock end: beside each phase's t0_unix + worst_gaps.
grep -H "cycle collector held" "$RES"/server-*.log "$RES"/proxy-*.log 2>/dev/null | tail -2000 > "$LOGS/gc-pauses.log"
# Kernels vLLM's JIT monitor saw compile while serving (each a one-time host stall of tens to
# hundreds of ms: a step the warm-up did not cover; none on the paced server at ed51eec).
grep -H "JIT compilation during inference" "$RES"/server-*.log 2>/dev/null | tail -200 > "$LOGS/jit-in-service.log"
tar czf "$OUT/defaults-logs.tar.gz" -C "$LOGS" .
# only this call's server's trace: a file left by an earlier server that traced is not this one's
if [ "${TRACE:-0}" = 1 ] && [ -f "$RES/paced-trace.jsonl" ]; then
  gzip -c "$RES/paced-trace.jsonl" > "$OUT/paced-trace.jsonl.gz"
else
  rm -f "$OUT/paced-trace.jsonl.gz"
fi
tar czf "$OUT/defaults-parts.tar.gz" -C "$RES" --exclude='server-*.log' --exclude=paced-trace.jsonl --exclude=prof \
  --exclude=logs . 2>/dev/null
n=$(find "$OUT" -path "$RES" -prune -o -type f -print | wc -l)  # (a dry run's WORK is inside OUT)
[ "$n" -le 8 ] || say "$n files under $OUT: a device call brings back 8 at most, some will stay behind"
say "done"

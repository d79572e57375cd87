# Shared by the H200 scripts: start vLLM servers (or the simulator with DRY_RUN=1), wait
# for health, bench the seed shape, put a prefill-gate in front, clean up. Source it after
# setting OUT, RES, MODEL, RUNS, UTIL, KV_BYTES (and WAIT, PROXY_LOG_LEVEL for proxy_up).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
t0=$(date +%s)
PIDS=()
declare -A PID_OF
say() { echo "[h200 +$(( $(date +%s) - t0 ))s] $*"; }

start_server() {  # name port args...: vLLM, or the simulator under DRY_RUN=1
  local name=$1 port=$2; shift 2
  if [ "${DRY_RUN:-0}" = 1 ]; then
    local sim_args=() skip=0
    for a in "$@"; do  # the simulator has vLLM's batch flags, not its engine internals
      if [ $skip = 1 ]; then skip=0; continue; fi
      case $a in --scheduler-cls|--compilation-config) skip=1 ;; *) sim_args+=("$a") ;; esac
    done
    setsid python3 -m prefill_gate.proxy sim --port "$port" --served-model-name m "${sim_args[@]}" \
      > "$RES/server-$name.log" 2>&1 &
  else
    setsid python3 -m vllm.entrypoints.cli.main serve "$MODEL" --served-model-name m \
      --load-format dummy --seed 0 --port "$port" --max-model-len 32768 \
      --gpu-memory-utilization "$UTIL" --kv-cache-memory-bytes "$KV_BYTES" "$@" \
      > "$RES/server-$name.log" 2>&1 &
  fi
  PIDS+=($!)
  PID_OF[$name]=$!
}

SERVERS_MARK=${SERVERS_MARK:-/tmp/prefill-gate-servers}  # what started the servers that outlive a call (setsid)

keep_only_servers_of() {  # what ports...: servers up on these ports that something else started are
  # stopped (their GPU memory freed), so that a script never measures another script's servers;
  # a script writes "$what" to $SERVERS_MARK when it starts its own
  local what=$1 port i; shift
  [ "$(cat "$SERVERS_MARK" 2>/dev/null)" = "$what" ] && return 0
  for port in "$@"; do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 || continue
    say "the server on :$port is not this run's ($(cat "$SERVERS_MARK" 2>/dev/null || echo "started elsewhere")): stopping it"
    stop_port "$port"
  done
}

stop_port() {  # port: the server on it (if any) stopped, its GPU memory freed
  local port=$1 i
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 || return 0
  say "stopping the server on :$port"
  pkill -INT -f -- "--port $port( |$)" 2>/dev/null
  for i in $(seq 60); do curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 || break; sleep 1; done
  pkill -KILL -f -- "--port $port( |$)" 2>/dev/null
  sleep 5
}

gdn_choice() {  # sweep.json: GDN_CHUNK, GDN_LIMIT and GDN_WALK from gdn_h200.sh's kernel stage
  # (gdn_sweep.py's `choose`), unless this call sets any of them
  [ -z "${GDN_LIMIT:-}${GDN_CHUNK:-}${GDN_WALK:-}" ] && [ -f "$1" ] || return 0
  read -r GDN_CHUNK GDN_LIMIT GDN_WALK < <(python3 bench/gpu/gdn_sweep.py --choice --json "$1")
  [ "$GDN_CHUNK" = off ] && GDN_CHUNK=
  [ "$GDN_WALK" = off ] && GDN_WALK=
  say "from the sweep: GDN_CHUNK=${GDN_CHUNK:-off} GDN_LIMIT=$GDN_LIMIT GDN_WALK=${GDN_WALK:-off}"
}

wait_health() {  # port timeout_s [pid]: fails at once if the server process died
  local deadline=$(( $(date +%s) + $2 ))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0
    if [ -n "${3:-}" ] && ! kill -0 "$3" 2>/dev/null; then return 1; fi
    sleep 2
  done
  return 1
}

stop_server() {  # name: SIGINT to its process group, then wait (60 s) until it has exited and freed the GPU
  local pid=${PID_OF[$1]} i
  kill -INT -- "-$pid" 2>/dev/null
  for i in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$pid" 2>/dev/null; sleep 2
}

proxy_up() {  # port upstream-port args...: a prefill-gate in front of a server (WAIT: its queue bound)
  local port=$1 upstream=$2; shift 2
  setsid python3 -m prefill_gate.proxy serve --upstream "http://127.0.0.1:$upstream" --port "$port" \
    --log-level "${PROXY_LOG_LEVEL:-warning}" --max-queue-wait "$WAIT" "$@" > "$RES/proxy-$port.log" 2>&1 &
  PIDS+=($!)
  wait_health "$port" 60 "$!"
}

proxy_down() {  # port: its /metrics kept, then stopped
  curl -s "http://127.0.0.1:$1/metrics" > "$RES/proxy-metrics-$1.txt"
  pkill -INT -f "proxy serve .*--port $1 " 2>/dev/null; sleep 1
}

cleanup() { for p in "${PIDS[@]}"; do kill -INT -- "-$p" 2>/dev/null; done; sleep 3;
            for p in "${PIDS[@]}"; do kill -KILL -- "-$p" 2>/dev/null; done; }

bench() {  # label url; with GPU_CLOCKS=1 the GPU's SM clock, power and temperature every 100 ms
  say "bench $1 -> $2"
  local sampler=""
  if [ "${GPU_CLOCKS:-0}" = 1 ] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,temperature.gpu \
      --format=csv,noheader -lms 100 > "$RES/gpu-clocks-$1.csv" 2>/dev/null &
    sampler=$!
  fi
  python3 -m prefill_gate.proxy bench overlap --base-url "$2" --model m --runs "$RUNS" --label "$1" \
    --json "$RES/$1.json" --plot "$RES/$1.png" 2>&1 | grep -v '^\[overlap\]' | tee -a "$RES/bench.log"
  [ -n "$sampler" ] && kill "$sampler" 2>/dev/null
  return 0
}

small_card() {  # true on a GPU of under 120 GiB (an 80 GB H100), false on an H200 or without a GPU
  local mib
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
  [ -n "$mib" ] && [ "$mib" -lt $((120 * 1024)) ]
}

gpu_info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$RES/gpu.txt" 2>/dev/null \
    || echo "none (dry run)" > "$RES/gpu.txt"
  say "gpu: $(cat "$RES/gpu.txt")"
}

bench_mixed() {  # label url [bench mixed args...]: steady load on SEED's schedule for DURATION s after
                 # BASELINE s of the users alone; RES/mixed-LABEL.json
  local label=$1 url=$2; shift 2
  say "bench mixed $label -> $url $*"
  python3 -m prefill_gate.proxy bench mixed --base-url "$url" --label "$label" --model m --seed "${SEED:-0}" \
    --duration "$DURATION" --baseline-duration "$BASELINE" --time-scale "${TIME_SCALE:-1}" \
    --json "$RES/mixed-$label.json" "$@" 2>&1 | grep -v '^\[mixed\]' | tee -a "$RES/bench.log"
}

mixed_report() {  # dir: every RES/mixed-*.json but the sparse rows merged into DIR/mixed.json, .png, -table.txt
  local main sparse
  main=$(ls "$RES"/mixed-*.json 2>/dev/null | grep -v '/mixed-sparse-' | sort)
  sparse=$(ls "$RES"/mixed-sparse-*.json 2>/dev/null | sort)
  [ -n "$main" ] && python3 -m prefill_gate.proxy bench mixed-report $main --json "$1/mixed.json" --plot "$1/mixed.png" \
    > "$1/mixed-table.txt" 2>&1
  [ -n "$sparse" ] && python3 -m prefill_gate.proxy bench mixed-report $sparse --json "$1/mixed-sparse.json" \
    > "$1/mixed-sparse-table.txt" 2>&1
  cat "$1"/mixed*-table.txt 2>/dev/null
}

pack_results() {  # name: RES packed into OUT/NAME.tar.gz (server logs as their last 200 KB), its JSON beside
  local f
  for f in "$RES"/server-*.log; do [ -f "$f" ] && tail -c 200000 "$f" > "${f%.log}-tail.txt"; done
  tar czf "$OUT/$1.tar.gz" -C "$RES" --exclude='server-*.log' .
  for f in "$RES"/*.json; do [ -f "$f" ] && cp "$f" "$OUT/"; done 2>/dev/null
  say "done"
}

# Sourced by bench/sim_*.sh: `bench defaults` on two fresh simulators, a model of the GPU runs.
#
#   defaults_on_sims JSON [SLICES_LOG] -- BENCH_DEFAULTS_ARGS...
#
# starts a stock simulator (plus the words of STOCK_SIM_ARGS) and a paced one (cap mode as
# compose's stack paces, plus the words of PACED_SIM_ARGS), runs `prefill-gate bench defaults` against them with the arguments after `--`
# and its JSON to JSON, keeps the proxies' "sliced request" lines in SLICES_LOG (if given), and
# stops both simulators.

sim_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
sim_up() { for _ in $(seq 100); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 0.1; done; return 1; }

defaults_on_sims() {
  local json=$1 slices="" stock paced s1 s2 work
  shift
  if [ "${1:-}" != -- ]; then slices=$1; shift; fi
  shift  # --
  stock=$(sim_port) paced=$(sim_port)
  # shellcheck disable=SC2086  # STOCK_SIM_ARGS, PACED_SIM_ARGS: words
  python3 -m prefill_gate sim --port "$stock" ${STOCK_SIM_ARGS:-} >/dev/null 2>&1 & s1=$!
  python3 -m prefill_gate sim --port "$paced" --pacing-cap 256 ${PACED_SIM_ARGS:-} >/dev/null 2>&1 & s2=$!
  sim_up "$stock" && sim_up "$paced"
  work=$(mktemp -d)
  python3 -m prefill_gate bench defaults --stock "http://127.0.0.1:$stock" --paced "http://127.0.0.1:$paced" \
    --work "$work" --json "$json" "$@" >/dev/null 2>&1
  [ -n "$slices" ] && { grep -h "sliced request" "$work"/proxy-*.log > "$slices" 2>/dev/null || true; }
  kill "$s1" "$s2"; wait "$s1" "$s2" 2>/dev/null || true; rm -rf "$work"
}

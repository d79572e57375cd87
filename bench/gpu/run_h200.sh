#!/usr/bin/env bash
# The starvation baseline vs prefill-gate on real vLLM 0.26.0, side by side in one run.
#
# On the GPU machine, from the repo root, after the recipe's chunk-only first run
# (bench/gpu/README.md says how):
#   source .gpu/device_setup.sh setup && bash bench/gpu/run_h200.sh "$OUT"
# Here, without a GPU, the same script against the simulator (same flag names):
#   DRY_RUN=1 bash bench/gpu/run_h200.sh out/h200-dry
#
# Starts one vLLM server per configuration at once (staggered; a fixed 10 GiB KV cache each;
# an idle server runs no steps, so benches run one at a time on a quiet GPU), benches
# each directly, then prefill-gate (default settings) in front of the 8192 server.
# Writes <config>.json/.png, summary.txt and logs, packed in OUT/h200.tar.gz.
set -u
OUT=${1:-out/h200}
MODEL=${MODEL:-.gpu/model-qwen3-8b}
RUNS=${RUNS:-3}
UTIL=${UTIL:-0.2}
KV_BYTES=${KV_BYTES:-10737418240}  # 10 GiB each: fixed, so concurrent starts cannot race vLLM's memory profiling
STAGGER=${STAGGER:-12}
mkdir -p "$OUT/res"
RES=$(cd "$OUT/res" && pwd)
source bench/gpu/lib.sh

# name port extra-args
CONFIGS=(
  "direct-8192 8001 --max-num-batched-tokens 8192"
  "direct-2048 8002 --max-num-batched-tokens 2048"
  "direct-maxseqs1 8003 --max-num-batched-tokens 8192 --max-num-seqs 1"
  "direct-lpt512 8004 --max-num-batched-tokens 8192 --long-prefill-token-threshold 512"
)
trap cleanup EXIT

gpu_info
for c in "${CONFIGS[@]}"; do
  set -- $c; name=$1; port=$2; shift 2
  say "starting $name on :$port ($*)"
  start_server "$name" "$port" "$@"
  sleep "$STAGGER"
done

for c in "${CONFIGS[@]}"; do
  set -- $c; name=$1; port=$2
  if wait_health "$port" 420 "${PID_OF[$name]}"; then say "$name healthy"; else say "$name did not come up"; tail -20 "$RES/server-$name.log"; fi
done
for c in "${CONFIGS[@]}"; do
  set -- $c; name=$1; port=$2
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && bench "$name" "http://127.0.0.1:$port"
  if [ "$name" = direct-8192 ]; then
    say "starting prefill-gate in front of direct-8192"
    setsid python3 -m prefill_gate.proxy serve --upstream "http://127.0.0.1:$port" --port 8090 --log-level warning \
      > "$RES/proxy.log" 2>&1 &
    PIDS+=($!)
    wait_health 8090 60 "$!" && bench proxy-8192 "http://127.0.0.1:8090"
    curl -s http://127.0.0.1:8090/metrics > "$RES/proxy-metrics.txt"
  fi
done

python3 - "$RES" <<'EOF'
import json, pathlib, sys
from prefill_gate.proxy.bench.report import OVERLAP_COLUMNS, markdown_table, table
res = pathlib.Path(sys.argv[1])
gpu = (res / "gpu.txt").read_text().split(",")[0].strip()
rows = []
for name in ["direct-8192", "direct-2048", "direct-maxseqs1", "direct-lpt512", "proxy-8192"]:
    p = res / f"{name}.json"
    if not p.exists():
        continue
    d = json.loads(p.read_text())
    d["config"], d["gpu"], d["vllm_version"] = name, gpu, d.get("server_version")
    p.write_text(json.dumps(d, indent=1) + "\n")
    rows.append(d)
(res / "summary.txt").write_text(table(rows, OVERLAP_COLUMNS) + "\n\n" + markdown_table(rows, OVERLAP_COLUMNS) + "\n")
print(table(rows, OVERLAP_COLUMNS))
EOF
tar czf "$OUT/h200.tar.gz" -C "$RES" .
cp "$RES/summary.txt" "$OUT/summary.txt"
say "done"

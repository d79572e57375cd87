#!/usr/bin/env bash
# issue 10 on the H200: --attention-backend CUSTOM against TRITON_ATTN, with and without n-gram
# speculative decoding, CUDA graphs on. Four vLLM workers start side by side (~30 GB each), check
# accuracy in parallel and take turns timing decode (bench/gpu/backend_h200.py holds the lock).
#
#   source .gpu/device_setup.sh setup && RES=$OUT/backend bash bench/gpu/backend_h200.sh
#   (float32 accuracy)                    DTYPE=float32 RES=$OUT/backend-fp32 bash bench/gpu/backend_h200.sh
set -u
RES=${RES:-out/backend}
mkdir -p "$RES"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
t0=$(date +%s)
# DTYPE=float32: accuracy only, two workers at a time (32 GB of weights each), exact dots.
DTYPE=${DTYPE:-auto}
worker() {  # backend spec expect
  VLLM_CACHE_ROOT=/root/vllm-cache-$1-$2-$DTYPE timeout "${WORKER_TIMEOUT:-500}" \
    python3 bench/gpu/backend_h200.py worker --backend "$1" --spec "$2" --out "$RES" --lock "$RES/decode.lock" \
      --expect "$3" --dtype "$DTYPE" $EXTRA > "$RES/$1-$2.log" 2>&1
}
if [ "$DTYPE" = float32 ]; then
  export TRITON_F32_DEFAULT=ieee EXTRA="--no-throughput --util 0.45 --kv-bytes $((8 << 30))"
  for spec in none ngram; do
    worker TRITON_ATTN "$spec" 2 & sleep "${STAGGER:-8}"; worker CUSTOM "$spec" 2 & wait
  done
else
  EXTRA=""
  for cfg in "TRITON_ATTN none" "CUSTOM none" "TRITON_ATTN ngram" "CUSTOM ngram"; do
    worker $cfg 4 &
    sleep "${STAGGER:-8}"
  done
  wait
fi
echo "[backend] workers done in $(( $(date +%s) - t0 )) s"
for f in "$RES"/*.log; do
  echo "== $f"; grep -E "^\[(CUSTOM|TRITON)|Error|error:|Traceback" "$f" | grep -v "^INFO" | tail -6
done
python3 bench/gpu/backend_h200.py compare "$RES" --json "$RES/backend-h200.json"

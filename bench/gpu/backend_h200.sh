#!/usr/bin/env bash
# issue 10 on the H200: --attention-backend CUSTOM against TRITON_ATTN, with and without n-gram
# speculative decoding, CUDA graphs on. Four vLLM workers start side by side (~30 GB each), check
# accuracy in parallel and take turns timing decode (bench/gpu/backend_h200.py holds the lock).
#
#   source .gpu/device_setup.sh setup && RES=$OUT/backend bash bench/gpu/backend_h200.sh
set -u
RES=${RES:-out/backend}
mkdir -p "$RES"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
t0=$(date +%s)
for cfg in "TRITON_ATTN none" "CUSTOM none" "TRITON_ATTN ngram" "CUSTOM ngram"; do
  set -- $cfg
  VLLM_CACHE_ROOT=/root/vllm-cache-$1-$2 timeout "${WORKER_TIMEOUT:-500}" \
    python3 bench/gpu/backend_h200.py worker --backend "$1" --spec "$2" --out "$RES" --lock "$RES/decode.lock" --expect 4 \
    > "$RES/$1-$2.log" 2>&1 &
  sleep "${STAGGER:-8}"
done
wait
echo "[backend] workers done in $(( $(date +%s) - t0 )) s"
for f in "$RES"/*.log; do
  echo "== $f"; grep -E "^\[(CUSTOM|TRITON)|Error|error:|Traceback" "$f" | grep -v "^INFO" | tail -6
done
python3 bench/gpu/backend_h200.py compare "$RES" --json "$RES/backend-h200.json"

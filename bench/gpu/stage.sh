#!/usr/bin/env bash
# Everything the device calls ship, built here in one command (no device time; ~3 min, mostly xz;
# needs PyPI and ../shared/gpu, the workplace's tested recipe):
#
#   bash bench/gpu/stage.sh            # build what is missing, then check it all
#   bash bench/gpu/stage.sh --check    # only check: what is there, what is missing (exit 1 if any)
#
# Builds, in the repository's ignored folders (added to .git/info/exclude):
#   .gpu/p1 .gpu/p2 ...        vLLM 0.26.0's slim site (~92 MiB) in chunks (CHUNK_MIB; by
#                              default the largest that fits beside the tracked tree, at most 32 MiB):
#                              one per call, under the 64 MiB a call may carry (--check says
#                              when the tree has grown past the chunks made before)
#   .gpu/device_setup.sh       `stash` a chunk / `setup` (assemble, unpack once, export PYTHONPATH)
#   .gpu/model-qwen3-8b        the dense model's folder (config + 256-token tokenizer; dummy weights)
#   .gpu/model-hybrid-27b      the 27B Gated DeltaNet hybrid's folder (bench/gpu/hybrid_model.py)
#   .gpu/ep                    prefill-gate's entry points (bench/gpu/dist_info.py)
#   .whl/                      httptools for the proxy (cp312), which the device image lacks
# STAGE_DIR (default .gpu) and WHEEL_DIR (default .whl) put them elsewhere (the tests use it).
set -euo pipefail
cd "$(dirname "$0")/../.."
STAGE=${STAGE_DIR:-.gpu}
WHEELS=${WHEEL_DIR:-.whl}
SHARED=${SHARED_GPU:-../shared/gpu}
tree_mib() {  # the tracked tree's size in MiB, rounded up (it travels with every call)
  git rev-parse --git-dir >/dev/null 2>&1 || { echo 0; return; }
  git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print int((s + 1048575) / 1048576)}'
}
# A chunk travels beside the tracked tree and ~1 MiB of setup, models, entry points and wheels:
# by default the largest that fits the 62 MiB a call may carry, at most 32 MiB.
AUTO_CHUNK=$(( 61 - $(tree_mib) ))
[ "$AUTO_CHUNK" -gt 32 ] && AUTO_CHUNK=32
CHUNK=${CHUNK_MIB:-$AUTO_CHUNK}M
CHUNK_BYTES=$(( ${CHUNK:0:-1} * 1048576 ))
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python  # has tokenizers, which the model folders need

chunks() {  # vLLM's site: p1..pN present, in order, each at most CHUNK, all of one build, each
  # small enough to travel beside the tracked tree (a call carries 64 MiB in all)
  local bad=0 item sha i=1 tree biggest
  compgen -G "$STAGE/p[0-9]*" >/dev/null || { echo "missing: $STAGE/p1 (a chunk of vLLM's site)"; return 1; }
  for item in $(ls -d "$STAGE"/p[0-9]* | sort -V); do
    if [ "$item" != "$STAGE/p$i" ]; then
      echo "missing: $STAGE/p$i (chunks go p1, p2, ... with no gap; found $item)"; bad=1; break
    elif ! compgen -G "$item/slim.tar.xz.part*" >/dev/null || [ ! -s "$item/slim.tar.xz.sha256" ]; then
      echo "missing: $item/slim.tar.xz.part* or its .sha256 (a chunk of vLLM's site)"; bad=1
    elif [ -n "$(find "$item" -name 'slim.tar.xz.part*' -size +"$CHUNK_BYTES"c)" ]; then
      echo "too big: $item (over $CHUNK: made by another split; run this script to split again)"; bad=1
    fi
    i=$((i + 1))
  done
  if [ "$bad" = 0 ]; then
    sha=$(cat "$STAGE/p1/slim.tar.xz.sha256")
    for item in "$STAGE"/p*/slim.tar.xz.sha256; do
      [ "$(cat "$item")" = "$sha" ] || { echo "stale: $item (chunks of two different builds)"; bad=1; }
    done
  fi
  if [ "$bad" = 0 ] && git rev-parse --git-dir >/dev/null 2>&1; then
    tree=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
    biggest=$(find "$STAGE"/p[0-9]* -name 'slim.tar.xz.part*' -printf '%s\n' | sort -n | tail -1)
    if [ $((tree + biggest)) -gt $((62 * 1048576)) ]; then
      echo "too big: the tracked tree ($((tree / 1048576)) MiB) and a chunk ($((biggest / 1048576)) MiB)" \
           "pass the 62 MiB a call may carry with room for the setup script (CHUNK_MIB=... splits smaller)"
      bad=1
    fi
  fi
  return "$bad"
}

check() {
  local missing=0 item
  chunks || missing=1
  [ -f "$STAGE/device_setup.sh" ] || { echo "missing: $STAGE/device_setup.sh"; missing=1; }
  for item in model-qwen3-8b model-hybrid-27b; do
    [ -f "$STAGE/$item/config.json" ] && [ -f "$STAGE/$item/tokenizer.json" ] \
      || { echo "missing: $STAGE/$item (config.json, tokenizer.json)"; missing=1; }
  done
  compgen -G "$STAGE/ep/*.dist-info/entry_points.txt" >/dev/null || { echo "missing: $STAGE/ep (entry points)"; missing=1; }
  compgen -G "$WHEELS/httptools-*cp312*.whl" >/dev/null || { echo "missing: $WHEELS/httptools (cp312 wheel)"; missing=1; }
  if [ "$missing" = 0 ]; then
    echo "staged: $(du -sh "$STAGE"/p[0-9]* | awk '{print $2"="$1}' | tr '\n' ' ')+ setup, models, ep, $WHEELS"
  fi
  return "$missing"
}

if [ "${1:-}" = "--check" ]; then
  check
  exit
fi

if git rev-parse --git-dir >/dev/null 2>&1; then
  exclude="$(git rev-parse --git-dir)/info/exclude"
  mkdir -p "$(dirname "$exclude")"
  for item in "$STAGE" "$WHEELS"; do
    case "$item" in /*) continue ;; esac  # outside the tree: nothing for git to ignore
    grep -qxF "/${item#./}/" "$exclude" 2>/dev/null || echo "/${item#./}/" >> "$exclude"
  done
fi
[ -d "$SHARED" ] || { echo "stage.sh: $SHARED not found (the workplace's GPU recipe; SHARED_GPU=... names it)" >&2; exit 2; }
mkdir -p "$STAGE" "$WHEELS"

if ! chunks >/dev/null; then
  rm -rf "$STAGE"/p[0-9]*
  if [ -s "$STAGE/slim.tar.xz" ] && [ -s "$STAGE/slim.tar.xz.sha256" ] \
      && [ "$(sha256sum "$STAGE/slim.tar.xz" | cut -d' ' -f1)" = "$(cat "$STAGE/slim.tar.xz.sha256")" ]; then
    echo "[stage] vLLM 0.26.0's slim site (built before), split again in chunks of $CHUNK"
    (cd "$STAGE" && split -b "$CHUNK" -d slim.tar.xz slim.tar.xz.part \
      && i=1 && for f in slim.tar.xz.part*; do mkdir -p "p$i" && mv "$f" "p$i/" && cp slim.tar.xz.sha256 "p$i/"; i=$((i + 1)); done)
  else
    echo "[stage] vLLM 0.26.0's slim site, in chunks of $CHUNK (~3 min)"
    sed "s/split -b [0-9]*M/split -b $CHUNK/" "$SHARED/stage_vllm.sh" > "$STAGE/stage_vllm.sh"
    bash "$STAGE/stage_vllm.sh" "$STAGE" > "$STAGE/stage.log" 2>&1 || { tail -20 "$STAGE/stage.log" >&2; exit 1; }
    rm -rf "$STAGE/site" "$STAGE/whl"  # the chunks and slim.tar.xz (kept to split again) hold it all
  fi
fi
cp "$SHARED/device_setup.sh" "$STAGE/"
[ -f "$STAGE/model-qwen3-8b/tokenizer.json" ] || "$PY" "$SHARED/make_model.py" "$STAGE/model-qwen3-8b"
[ -f "$STAGE/model-hybrid-27b/tokenizer.json" ] \
  || "$PY" bench/gpu/hybrid_model.py "$STAGE/model-qwen3-8b" "$STAGE/model-hybrid-27b" >/dev/null
python3 bench/gpu/dist_info.py "$STAGE/ep" >/dev/null
compgen -G "$WHEELS/httptools-*cp312*.whl" >/dev/null || python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$WHEELS" httptools
check

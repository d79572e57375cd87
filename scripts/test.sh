#!/usr/bin/env bash
# Install everything the tests need into .venv and run them (CPU only, no network
# beyond the package index). The README's test command and CI run exactly this.
#
#   1. the proxy with its test extras, at the versions of requirements/test.lock, and the
#      relay's compiled core (prefill_gate/proxy/_relaycore.c: pip builds it with the C compiler; its
#      tests fail rather than skip here, PREFILL_GATE_REQUIRE_COMPILED);
#   2. vLLM 0.26.0's scheduler for the engine_patches tests: the CPU build of torch and
#      what vLLM imports (requirements/engine-cpu.txt), then vLLM itself without its
#      dependencies (requirements/engine-nodeps.txt: its torch pin is a CUDA build of
#      several GB). About 80 s and 2 GB on a 2-core machine;
#   3. Prometheus and promtool (Debian's `prometheus` package) for the deploy/ tests, when
#      missing and apt-get can install them (~15 s);
#   4. the Prometheus operator's API types from npm (tests/deploy/npm, its lock; ~10 s) for
#      the PodMonitor's check (Node.js runs its validator).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q prometheus >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q prometheus >/dev/null 2>&1; } \
      || echo "scripts/test.sh: could not install Debian's prometheus package" >&2
  fi
fi
# The Prometheus operator's API types (npm, pinned by its lock) for the PodMonitor's check.
if command -v npm >/dev/null; then
  npm ci --prefix tests/deploy/npm --silent --no-audit --no-fund \
    || echo "scripts/test.sh: npm could not install tests/deploy/npm" >&2
fi
python3 -m venv .venv
# Every version pinned by requirements/test.lock (constraints): a new release upstream cannot
# change what CI tests with.
.venv/bin/pip install -q -c requirements/test.lock -e ".[test]" -r requirements/engine-cpu.txt
.venv/bin/pip install -q --no-deps -c requirements/test.lock -r requirements/engine-nodeps.txt
PREFILL_GATE_REQUIRE_ENGINE=1 PREFILL_GATE_REQUIRE_DEPLOY_TOOLS=1 PREFILL_GATE_REQUIRE_COMPILED=1 exec .venv/bin/python -m pytest "$@"

#!/usr/bin/env bash
# The README's first command: installs what is missing, builds, and runs kvpool's main
# job: a short tour of the cost-model calculators (`kvctl calc`), then a local cluster
# (router + 2 pool nodes + 2 tiny-gqa workers on 127.0.0.1, deploy/local/cluster.sh)
# driven by about two minutes of the Mooncake trace (`kvctl replay`), its report, the
# router's and the workers' statistics, and the cluster stopped again — also on a failure
# or Ctrl-C (nothing is left running).
#
# Knobs (environment): KVPOOL_RUN_DIR (logs, pid files, NVMe tiers; build/local-cluster),
# KVPOOL_BASE_PORT (router port, 50051; pool nodes +10, workers +20),
# KVPOOL_METRICS_BASE (first /metrics port, 9101), KVPOOL_REPLAY_SPEED / _LIMIT /
# _MAX_PROMPT / _CONCURRENCY (the replay's --speed, --limit, --max-prompt-tokens,
# --concurrency).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh default
BIN=build/default
KVCTL=$BIN/router/cli/kvctl
run() { echo; echo "\$ kvctl $*"; "$KVCTL" "$@"; }
echo
echo "== kvpool: what a prefix-cache hit is worth =="
run calc kv --model llama-3.3-70b --context 8192
run calc kv --model deepseek-v3 --kv-dtype fp8
run calc ttft --model llama-3.3-70b --context 8192 --hit 0.8 --tier dram --queue 0.1
run calc ttft --model llama-3.3-70b --context 8192 --hit 0.8 --tier nvme --queue 0.1

if [[ ! -x $BIN/worker/service/kvpool-worker ]]; then
  echo
  echo "kvpool-worker is not built in $BIN; skipping the local cluster."
  exit 0
fi

RUN_DIR="${KVPOOL_RUN_DIR:-build/local-cluster}"
BASE_PORT="${KVPOOL_BASE_PORT:-50051}"
METRICS_BASE="${KVPOOL_METRICS_BASE:-9101}"
ROUTER="127.0.0.1:$BASE_PORT"
TRACE="$(pwd)/../shared/data/traces/synthetic_trace.jsonl"
# The trace brings ~3.9 requests/s for 17 minutes, more than a 2-core CPU computes. Its
# first 200 requests in real time (x1: arrivals over 58 s), prompts cut to 1,024 tokens
# (133k prompt tokens), are about what two 1-thread tiny-gqa workers keep up with: about
# two minutes of wall time (--max-duration stops sending after 150 s on a slower machine).
SPEED="${KVPOOL_REPLAY_SPEED:-1}"
LIMIT="${KVPOOL_REPLAY_LIMIT:-200}"
MAX_PROMPT="${KVPOOL_REPLAY_MAX_PROMPT:-1024}"
CONCURRENCY="${KVPOOL_REPLAY_CONCURRENCY:-8}"

# Never stop a cluster this script did not start (e.g. one started by hand in RUN_DIR).
if [[ "$(bash deploy/local/cluster.sh status --dir "$RUN_DIR" 2>/dev/null || true)" == *" alive "* ]]; then
  echo "run.sh: a cluster is already running in $RUN_DIR; stop it first:" >&2
  echo "  bash deploy/local/cluster.sh stop --dir $RUN_DIR" >&2
  exit 1
fi
stopped=0
cleanup() {
  [[ $stopped == 1 ]] && return 0
  stopped=1
  echo
  echo "== stopping the cluster =="
  bash deploy/local/cluster.sh stop --dir "$RUN_DIR" || true
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM

echo
echo "== a local kvpool cluster: router, 2 pool nodes (DRAM + NVMe), 2 tiny-gqa workers =="
bash deploy/local/cluster.sh start --dir "$RUN_DIR" --bin-dir "$BIN" --base-port "$BASE_PORT" \
  --metrics-base "$METRICS_BASE"

echo
echo "== replaying the Mooncake trace (first $LIMIT requests, x$SPEED, prompts <= $MAX_PROMPT tokens) =="
run replay --trace "$TRACE" --router "$ROUTER" --model tiny-gqa --speed "$SPEED" --limit "$LIMIT" \
  --max-prompt-tokens "$MAX_PROMPT" --max-new-tokens 8 --concurrency "$CONCURRENCY" --max-duration 150 \
  --progress-interval 10 --csv "$RUN_DIR/replay.csv"
echo "(per-request log: $RUN_DIR/replay.csv)"

echo
echo "== the router =="
run status --router "$ROUTER"

# Each worker's statistics, from its Prometheus /metrics (ports: router, pool nodes, workers).
echo
echo "== the workers (/metrics) =="
for i in 0 1; do
  port=$((METRICS_BASE + 3 + i))
  echo
  echo "\$ curl -s http://127.0.0.1:$port/metrics   # worker-$i"
  curl -s --max-time 5 "http://127.0.0.1:$port/metrics" | grep -v '^#' | grep -E '^kvpool_worker' |
    grep -v -E '_bucket|_sum' || true
done
echo
echo "== the pool nodes (/metrics) =="
for i in 0 1; do
  port=$((METRICS_BASE + 1 + i))
  echo
  echo "\$ curl -s http://127.0.0.1:$port/metrics   # pool-$([[ $i == 0 ]] && echo a || echo b)"
  curl -s --max-time 5 "http://127.0.0.1:$port/metrics" | grep -v '^#' |
    grep -E '^kvpool_pool_(demotions|promotions|evictions|objects|used_bytes|capacity_bytes)' || true
done

#!/usr/bin/env bash
# The README's first command: installs what is missing, builds, and runs kvpool's
# main job — for now a tour of the cost-model calculators (`kvctl calc`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh default
KVCTL=build/default/router/cli/kvctl
run() { echo; echo "\$ kvctl $*"; "$KVCTL" "$@"; }
echo
echo "== kvpool: what a prefix-cache hit is worth =="
run calc kv --model llama-3.3-70b --context 8192
run calc kv --model deepseek-v3 --kv-dtype fp8
run calc kv --model kimi-k3 --context 8192
run calc util --max-len 4096 --page-size 16 --hbm-free 40GiB --model llama-3.3-70b
run calc ttft --model llama-3.3-70b --context 8192 --hit 0.8 --tier dram --queue 0.1
run calc ttft --model llama-3.3-70b --context 8192 --hit 0.8 --tier nvme --queue 0.1

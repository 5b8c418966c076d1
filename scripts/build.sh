#!/usr/bin/env bash
# Configures and builds one preset (default: `default`). Used by run.sh and test.sh.
# Usage: scripts/build.sh [preset] [ninja targets...]
set -euo pipefail
cd "$(dirname "$0")/.."
preset="${1:-default}"
shift || true
# Configuration's own lines stay quiet except kvpool's (whether CUDA was found).
configure_log="$(mktemp)"
trap 'rm -f "$configure_log"' EXIT
cmake --preset "$preset" >"$configure_log"
grep '^-- kvpool:' "$configure_log" || true
if [[ $# -gt 0 ]]; then
  cmake --build --preset "$preset" --target "$@"
else
  cmake --build --preset "$preset"
fi

#!/usr/bin/env bash
# The README's second command: installs what is missing, builds, and runs every test
# with CTest (RelWithDebInfo), then the core libraries' tests again under ASan+UBSan.
# Exits non-zero on any failure. .ci/run calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh default
ctest --preset default --output-on-failure -j2
# ASan + UBSan over the libraries with no network services (fast to build): every test
# binary labelled `core`, as the configure step lists them.
cmake --preset asan >/dev/null
bash scripts/build.sh asan $(cat build/asan/kvpool-core-tests.txt)
ctest --preset asan --output-on-failure -j2 -L core

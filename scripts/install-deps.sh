#!/usr/bin/env bash
# Installs the Debian packages kvpool builds, tests and runs with — only those that
# are missing. Idempotent and fast when everything is present (one dpkg-query); runs
# `apt-get update` once, and only when something has to be installed.
#
# Usage: scripts/install-deps.sh [--check]   (--check: list what is missing, install nothing)
set -euo pipefail

PACKAGES=(
  # toolchain
  g++ cmake ninja-build pkgconf git
  # RPC and serialization
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  # data plane and storage
  libucx-dev ucx-utils liburing-dev
  # libraries
  libabsl-dev libxxhash-dev libcli11-dev libspdlog-dev nlohmann-json3-dev libcpp-httplib-dev
  # tests and benchmarks
  libgtest-dev libgmock-dev libbenchmark-dev fio
  # charts (kvctl simulate --compare), multi-host tests (ip netns), process tools
  gnuplot-nox iproute2 procps psmisc curl python3 python3-yaml
)

missing=()
while read -r pkg status; do
  [[ "$status" == "installed" ]] || missing+=("$pkg")
done < <(dpkg-query -W -f='${Package} ${db:Status-Status}\n' "${PACKAGES[@]}" 2>/dev/null || true)
# dpkg-query prints nothing for packages it has never heard of.
for pkg in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${db:Status-Status}' "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u | sed '/^$/d')

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi
if [[ "${1:-}" == "--check" ]]; then
  echo "install-deps: missing: ${missing[*]}"
  exit 1
fi
echo "install-deps: installing ${missing[*]}"
SUDO=""
[[ $(id -u) -eq 0 ]] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install-deps: done"

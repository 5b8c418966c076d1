#!/usr/bin/env bash
# Builds the CUDA kernel targets HERE (nvcc, sm_90a) and packs them, with the shared
# libraries they need beyond glibc and the CUDA driver, into one folder that a
# GPU machine without kvpool's Debian packages (no gRPC, abseil, package registry) can
# run: scripts/gpu-check.sh --prebuilt DIR.
#
# Usage: scripts/gpu-bundle.sh [DIR]   (default: .gpu in the repo root; git ignores it)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-${ROOT}/.gpu}"
BUILD="${ROOT}/build/gpu-bundle"
# DIR is replaced whole: refuse a folder that is not an earlier bundle.
if [[ -e "${DIR}" && ! -f "${DIR}/commit" ]]; then
  echo "gpu-bundle: ${DIR} exists and is not a bundle (no commit file); name a new folder" >&2
  exit 2
fi
NVCC="${CUDACXX:-/usr/local/cuda/bin/nvcc}"
[[ -x "${NVCC}" ]] || NVCC="$(command -v nvcc || true)"
[[ -n "${NVCC}" && -x "${NVCC}" ]] || { echo "gpu-bundle: nvcc not found (set CUDACXX)" >&2; exit 2; }

mkdir -p "${BUILD}"
cmake -S "${ROOT}" -B "${BUILD}" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVPOOL_CUDA=ON \
  -DCMAKE_CUDA_COMPILER="${NVCC}" -DCMAKE_EXE_LINKER_FLAGS="" >"${BUILD}/bundle-configure.log" 2>&1 \
  || { tail -20 "${BUILD}/bundle-configure.log"; exit 3; }
grep -q "kernels/ builds for sm_90a" "${BUILD}/bundle-configure.log" \
  || { echo "gpu-bundle: configure did not enable CUDA (see ${BUILD}/bundle-configure.log)" >&2; exit 3; }
cmake --build "${BUILD}" -j "$(nproc)" --target kernels_gpu_test kernels_bench

rm -rf "${DIR}"
mkdir -p "${DIR}/lib"
for bin in tests/kernels/kernels_gpu_test kernels/kernels_bench; do
  # Host debug info is not needed there; the device code keeps its -lineinfo.
  objcopy --strip-debug "${BUILD}/${bin}" "${DIR}/$(basename "${bin}")"
  if ldd "${BUILD}/${bin}" | grep -q "not found"; then
    echo "gpu-bundle: ${bin} has unresolved libraries:" >&2
    ldd "${BUILD}/${bin}" | grep "not found" >&2
    exit 4
  fi
  # Every resolved library except glibc's and the driver (the machine's own); libstdc++
  # and libgcc_s go along, since the GPU machine's may be older than the ones we built with.
  ldd "${BUILD}/${bin}" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' \
    | { grep -Ev '/(libc|libm|libdl|libpthread|librt|libcuda)\.so' || true; } \
    | while read -r lib; do cp -Lu "${lib}" "${DIR}/lib/"; done
done
git -C "${ROOT}" rev-parse HEAD >"${DIR}/commit" 2>/dev/null || true
git -C "${ROOT}" status --short -- kernels tests/kernels >"${DIR}/dirty" 2>/dev/null || true
"${NVCC}" --version | tail -1 >"${DIR}/nvcc"
echo "gpu-bundle: ${DIR} ($(du -sh "${DIR}" | cut -f1)); run there: scripts/gpu-check.sh --prebuilt ${DIR#"${ROOT}"/}"

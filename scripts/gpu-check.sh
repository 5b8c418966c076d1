#!/usr/bin/env bash
# Builds the CUDA kernels and runs the GPU-labelled tests and the GPU benchmark, on a
# machine with an NVIDIA GPU (sm_90: H100/H200) and this repo's working tree.
# Budget: under 10 minutes on a fresh machine (deps ~2-4 min, build ~2-3 min of the
# kernel targets only, tests + bench ~1-2 min).
#
# Usage: scripts/gpu-check.sh            (results under $OUT if set, else build/gpu-check/out)
#        scripts/gpu-check.sh --prebuilt DIR
#            runs binaries that scripts/gpu-bundle.sh built elsewhere (nvcc, sm_90a) and
#            packed with their libraries: for a GPU machine with no Debian packages and no
#            package registry, where steps 1-2 cannot work. Skips to step 3.
# Env: GPU_CHECK_CPU_BENCH=0 skips the CPU reference bench.
# Writes: nvidia-smi.txt, ctest-gpu.log, ctest-gpu.xml (JUnit), kernels_bench_gpu.json,
#         kernels_bench_cpu.json (same run, for comparison), summary.txt.
# Exit status: non-zero when configure/build fails, any gpu test fails, or the tests
# skipped because the CUDA backend was not usable (no device, driver too old).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREBUILT=""
if [[ "${1:-}" == "--prebuilt" ]]; then
  [[ -n "${2:-}" && -x "${2}/kernels_gpu_test" && -x "${2}/kernels_bench" ]] \
    || { echo "gpu-check: --prebuilt needs a folder from scripts/gpu-bundle.sh (kernels_gpu_test, kernels_bench, lib/)" >&2; exit 2; }
  PREBUILT="$(cd "$2" && pwd)"
elif [[ $# -gt 0 ]]; then
  echo "usage: scripts/gpu-check.sh [--prebuilt DIR]" >&2; exit 2
fi
BUILD="${ROOT}/build/gpu-check"
RESULTS="${OUT:-${BUILD}/out}"
mkdir -p "${RESULTS}"
JOBS="$(nproc 2>/dev/null || echo 8)"
start=$(date +%s)
log() { echo "gpu-check [$(( $(date +%s) - start ))s]: $*" | tee -a "${RESULTS}/summary.txt"; }

if [[ -n "${PREBUILT}" ]]; then
  log "prebuilt binaries from ${PREBUILT} (commit $(cat "${PREBUILT}/commit" 2>/dev/null), $(cat "${PREBUILT}/nvcc" 2>/dev/null))"
  [[ -s "${PREBUILT}/dirty" ]] && log "built with uncommitted changes: $(tr '\n' ' ' <"${PREBUILT}/dirty")"
  export LD_LIBRARY_PATH="${PREBUILT}/lib${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
  nvidia-smi >"${RESULTS}/nvidia-smi.txt" 2>&1 || log "warning: nvidia-smi failed; the gpu tests will skip"
  GPU_TEST="${PREBUILT}/kernels_gpu_test"
  BENCH="${PREBUILT}/kernels_bench"
else
  # 1. Toolchain and Debian packages.
  if [[ -x "${ROOT}/scripts/install-deps.sh" || -f "${ROOT}/scripts/install-deps.sh" ]]; then
    log "installing missing Debian packages (scripts/install-deps.sh)"
    timeout 300 bash "${ROOT}/scripts/install-deps.sh" >"${RESULTS}/install-deps.log" 2>&1 \
      || log "install-deps.sh failed (see install-deps.log); trying to build anyway"
  else
    log "scripts/install-deps.sh not found; apt-get installing the build dependencies"
    SUDO=""; [[ "$(id -u)" != 0 ]] && SUDO="sudo"
    timeout 300 ${SUDO} apt-get update -qq >"${RESULTS}/install-deps.log" 2>&1
    timeout 300 ${SUDO} env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      g++ cmake ninja-build pkgconf libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev \
      protobuf-compiler libucx-dev liburing-dev libabsl-dev libxxhash-dev libcli11-dev \
      libspdlog-dev nlohmann-json3-dev libcpp-httplib-dev libgtest-dev libgmock-dev \
      libbenchmark-dev grpc-proto >>"${RESULTS}/install-deps.log" 2>&1 || log "apt-get failed (see install-deps.log)"
  fi

  NVCC=""
  for c in "${CUDACXX:-}" /usr/local/cuda/bin/nvcc "$(command -v nvcc 2>/dev/null)"; do
    [[ -n "$c" && -x "$c" ]] && { NVCC="$c"; break; }
  done
  if [[ -z "${NVCC}" ]]; then
    log "FAIL: nvcc not found (install the CUDA toolkit at /usr/local/cuda or set CUDACXX)"
    exit 2
  fi
  nvidia-smi >"${RESULTS}/nvidia-smi.txt" 2>&1 || log "warning: nvidia-smi failed; the gpu tests will skip"
  log "nvcc: ${NVCC} ($("${NVCC}" --version | tail -1))"

  # 2. Configure with CUDA and build only the kernel targets.
  log "configuring ${BUILD}"
  if ! timeout 240 cmake -S "${ROOT}" -B "${BUILD}" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DKVPOOL_CUDA=ON -DCMAKE_CUDA_COMPILER="${NVCC}" >"${RESULTS}/configure.log" 2>&1; then
    log "FAIL: configure (see configure.log)"; tail -20 "${RESULTS}/configure.log"; exit 3
  fi
  grep -q "kernels/ builds for sm_90a" "${RESULTS}/configure.log" \
    || { log "FAIL: configure did not enable CUDA (see configure.log)"; exit 3; }
  log "building kernels_gpu_test kernels_test kernels_bench (-j${JOBS})"
  if ! timeout 420 cmake --build "${BUILD}" -j "${JOBS}" \
        --target kernels_gpu_test kernels_test kernels_bench >"${RESULTS}/build.log" 2>&1; then
    log "FAIL: build (see build.log)"; tail -30 "${RESULTS}/build.log"; exit 4
  fi

  GPU_TEST="${BUILD}/tests/kernels/kernels_gpu_test"
  BENCH="${BUILD}/kernels/kernels_bench"
fi

# 3. GPU tests (label gpu). A skip here means the CUDA backend was not usable: fail.
if [[ -n "${PREBUILT}" ]]; then
  log "running kernels_gpu_test (the gpu label's one binary)"
  timeout 300 "${GPU_TEST}" --gtest_output="xml:${RESULTS}/ctest-gpu.xml" >"${RESULTS}/ctest-gpu.log" 2>&1
  test_rc=$?
  log "gpu tests: rc=${test_rc}; $(grep -E '^\[ +(PASSED|FAILED|SKIPPED) +\] [0-9]+ tests?' "${RESULTS}/ctest-gpu.log" | tr '\n' ' ')"
  grep -E '^\[ +FAILED +\] [A-Za-z]' "${RESULTS}/ctest-gpu.log" | head -40 | tee -a "${RESULTS}/summary.txt"
else
  log "running ctest -L gpu"
  (cd "${BUILD}" && timeout 300 ctest -L gpu --output-on-failure --timeout 240 \
     --output-junit "${RESULTS}/ctest-gpu.xml") >"${RESULTS}/ctest-gpu.log" 2>&1
  test_rc=$?
  skipped=$(grep -c "Skipped" "${RESULTS}/ctest-gpu.log" || true)
  log "gpu tests: rc=${test_rc}; $(grep -E 'tests passed|tests failed' "${RESULTS}/ctest-gpu.log" | tail -1); skipped=${skipped}"
  if [[ "${skipped}" != 0 ]]; then
    log "note: skipped tests are the host-only argument checks or mean no usable GPU; see ctest-gpu.log"
  fi
fi
# Tests skip (and pass) when the CUDA backend cannot be created; here that is a failure.
if grep -q "CUDA kernel backend not usable here" "${RESULTS}/ctest-gpu.log"; then
  log "FAIL: the CUDA backend was not usable: $(grep -m1 -o 'CUDA kernel backend not usable here.*' "${RESULTS}/ctest-gpu.log")"
  test_rc=5
fi

# 4. Benchmarks: GPU (fractions of a device-to-device copy) and CPU for reference.
log "running kernels_bench --backend=cuda --json"
timeout 180 "${BENCH}" --backend=cuda --json \
  >"${RESULTS}/kernels_bench_gpu.json" 2>"${RESULTS}/kernels_bench_gpu.err" \
  || log "gpu bench failed (see kernels_bench_gpu.err)"
if [[ "${GPU_CHECK_CPU_BENCH:-1}" != 0 ]]; then  # GPU_CHECK_CPU_BENCH=0 saves device time
  timeout 120 "${BENCH}" --backend=cpu_optimized --quick --json \
    >"${RESULTS}/kernels_bench_cpu.json" 2>"${RESULTS}/kernels_bench_cpu.err" \
    || log "cpu bench failed (see kernels_bench_cpu.err)"
fi
if [[ -s "${RESULTS}/kernels_bench_gpu.json" ]]; then
  grep -A20 '"targets"' "${RESULTS}/kernels_bench_gpu.json" | tee -a "${RESULTS}/summary.txt"
fi
log "done; results in ${RESULTS}"
exit "${test_rc}"

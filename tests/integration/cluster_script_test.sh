#!/usr/bin/env bash
# deploy/local/cluster.sh start / status / stop on ports picked free at run time, in a temp
# run directory: everything comes up SERVING, the router lists it, status says alive,
# and stop leaves no process behind.
# Usage: cluster_script_test.sh <source dir> <build dir>
# Exit 77 (CTest: skipped) when kvpool-worker is not built; the router + pool node part
# is still checked first.
set -euo pipefail
SRC="$1"
BIN="$2"
CLUSTER="$SRC/deploy/local/cluster.sh"
KVCTL="$BIN/router/cli/kvctl"
WORKER_BIN="$BIN/worker/service/kvpool-worker"

fail() { echo "FAIL: $*" >&2; exit 1; }

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# A base port whose router, pool node and worker ports are all free, below the kernel's
# ephemeral range (ip_local_port_range, 32768-60999 by default): a port checked free here
# cannot then be handed to some other test's (or this cluster's own) outgoing connection
# or port-0 listener before the server binds it.
pick_base() {
  local try p ok lo=32768
  read -r lo _ < /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || true
  (( lo > 20100 )) || lo=32768
  for ((try = 0; try < 200; try++)); do
    p=$((20000 + (RANDOM * 32768 + RANDOM) % (lo - 20000 - 30)))
    ok=1
    for q in $p $((p + 10)) $((p + 11)) $((p + 20)) $((p + 21)); do
      port_free "$q" || { ok=0; break; }
    done
    [[ $ok == 1 ]] && { echo "$p"; return 0; }
  done
  return 1
}

RUN_DIR="$(mktemp -d "${TMPDIR:-/tmp}/kvpool-cluster-script-XXXXXX")"
cleanup() {
  bash "$CLUSTER" stop --dir "$RUN_DIR" >/dev/null 2>&1 || true
  rm -rf "$RUN_DIR"
}
trap cleanup EXIT

# check <workers>: one start / status / stop cycle.
check() {
  local workers="$1" base pids=() expect=$((3 + $1)) n
  base="$(pick_base)" || fail "no free base port"
  echo "== cluster.sh start --workers $workers --base-port $base --dir $RUN_DIR"
  # Small tiers: a test machine has little room to spare.
  bash "$CLUSTER" start --dir "$RUN_DIR" --bin-dir "$BIN" --base-port "$base" --workers "$workers" \
    --num-blocks 128 --dram 16MiB --nvme 32MiB || fail "start failed (output above)"

  echo "== cluster.sh status"
  local status
  status="$(bash "$CLUSTER" status --dir "$RUN_DIR")" || { echo "$status"; fail "status says something is dead"; }
  echo "$status"
  n="$(grep -c ' alive ' <<<"$status" || true)"
  [[ "$n" == "$expect" ]] || fail "status shows $n processes alive, want $expect"
  for f in "$RUN_DIR"/*.pid; do pids+=("$(cat "$f")"); done
  [[ ${#pids[@]} == "$expect" ]] || fail "${#pids[@]} pid files, want $expect"

  echo "== kvctl status --router 127.0.0.1:$base"
  local rs
  rs="$("$KVCTL" status --router "127.0.0.1:$base")" || fail "kvctl status failed: $rs"
  echo "$rs"
  local ids=(pool-a pool-b)
  for ((n = 0; n < workers; n++)); do ids+=("worker-$n"); done
  for id in "${ids[@]}"; do
    grep -q -- "$id" <<<"$rs" || fail "the router does not list $id"
  done

  echo "== cluster.sh start again (refused while running)"
  if bash "$CLUSTER" start --dir "$RUN_DIR" --bin-dir "$BIN" --base-port "$base" --workers "$workers" \
      >/dev/null 2>&1; then
    fail "a second start in the same run dir succeeded"
  fi

  echo "== cluster.sh stop"
  bash "$CLUSTER" stop --dir "$RUN_DIR" || fail "stop failed"
  for p in "${pids[@]}"; do
    if kill -0 "$p" 2>/dev/null && [[ "$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)" != Z ]]; then
      fail "pid $p still running after stop"
    fi
  done
  ! compgen -G "$RUN_DIR/*.pid" >/dev/null || fail "pid files left: $(ls "$RUN_DIR"/*.pid)"
  if bash "$CLUSTER" status --dir "$RUN_DIR" >/dev/null; then fail "status says alive after stop"; fi
  for q in $base $((base + 10)) $((base + 11)); do
    port_free "$q" || fail "port $q still in use after stop"
  done
  echo "ok: workers=$workers"
}

# A start that is interrupted (SIGTERM; Ctrl-C's SIGINT takes the same trap) stops what
# it had started: no server is left running and no pid file stays. Its pool node is a
# stub that never becomes healthy (fault injection), so the start is certainly still
# waiting when the signal comes (with the real one a start could end first under load).
check_interrupted_start() {
  local base script_pid pids=() i stub="$RUN_DIR/stub-bin"
  base="$(pick_base)" || fail "no free base port"
  mkdir -p "$stub/router/cli" "$stub/pool-node"
  ln -sf "$BIN/router/kvpool-router" "$stub/router/kvpool-router"
  ln -sf "$KVCTL" "$stub/router/cli/kvctl"
  # exec -a keeps "kvpool-" in its command line, which cluster.sh requires to signal it.
  printf '#!/usr/bin/env bash\nexec -a kvpool-node-stub sleep 600\n' > "$stub/pool-node/kvpool-node"
  chmod +x "$stub/pool-node/kvpool-node"
  echo "== cluster.sh start, interrupted while it waits for a pool node"
  bash "$CLUSTER" start --dir "$RUN_DIR" --bin-dir "$stub" --base-port "$base" --workers 0 \
    --num-blocks 128 --dram 16MiB --nvme 32MiB --wait 60 > "$RUN_DIR/interrupted.out" 2>&1 &
  script_pid=$!
  for ((i = 0; i < 300; i++)); do
    [[ -s "$RUN_DIR/pool-a.pid" ]] && break
    sleep 0.1
  done
  [[ -s "$RUN_DIR/pool-a.pid" ]] || fail "the pool node was not started: $(cat "$RUN_DIR/interrupted.out")"
  for f in "$RUN_DIR"/*.pid; do pids+=("$(cat "$f")"); done
  kill -TERM "$script_pid" 2>/dev/null || fail "the start had ended before it could be interrupted: $(cat "$RUN_DIR/interrupted.out")"
  wait "$script_pid" && fail "an interrupted start exited 0"
  grep -q "interrupted; stopping" "$RUN_DIR/interrupted.out" || fail "no interruption message: $(cat "$RUN_DIR/interrupted.out")"
  for p in "${pids[@]}"; do
    if kill -0 "$p" 2>/dev/null && [[ "$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)" != Z ]]; then
      fail "pid $p still running after an interrupted start"
    fi
  done
  ! compgen -G "$RUN_DIR/*.pid" >/dev/null || fail "pid files left: $(ls "$RUN_DIR"/*.pid)"
  echo "ok: interrupted start"
}

# Bad flag values are refused before anything starts, naming the flag (a --wait of 1.5
# used to end the script in the middle of starting, with the router left running).
check_bad_flags() {
  local base out
  base="$(pick_base)" || fail "no free base port"
  for wait in 1.5 abc 0; do
    if out="$(bash "$CLUSTER" start --dir "$RUN_DIR" --bin-dir "$BIN" --base-port "$base" --workers 0 \
        --wait "$wait" 2>&1)"; then
      fail "start --wait $wait succeeded"
    fi
    grep -q -- "--wait=$wait" <<<"$out" || fail "no message naming --wait for $wait: $out"
    ! compgen -G "$RUN_DIR/*.pid" >/dev/null || fail "start --wait $wait left pid files: $(ls "$RUN_DIR"/*.pid)"
  done
  echo "ok: bad flags"
}

check 0
check_bad_flags
check_interrupted_start
if [[ ! -x "$WORKER_BIN" ]]; then
  echo "SKIP: $WORKER_BIN is not built; only router + pool nodes were checked"
  exit 77
fi
check 2
echo "PASS"

#!/usr/bin/env bash
# A kvpool cluster on 127.0.0.1: a router, pool nodes (small DRAM + an NVMe tier under the
# run directory, so blocks really demote to NVMe) and workers. See deploy/local/README.md.
#
#   deploy/local/cluster.sh start  [options]   launch everything, wait for health
#   deploy/local/cluster.sh status [options]   one line per process: alive / dead
#   deploy/local/cluster.sh stop   [options]   TERM, wait, KILL; remove the pid files
#
# Options (environment variable in brackets):
#   --dir DIR          run directory: logs, pid files, NVMe tiers [KVPOOL_RUN_DIR]
#                      (default build/local-cluster)
#   --bin-dir DIR      build directory holding the binaries [KVPOOL_BIN_DIR] (default build/default)
#   --base-port P      router port; pool nodes P+10.., workers P+20.. [KVPOOL_BASE_PORT] (50051)
#   --model M          model the workers serve (default tiny-gqa)
#   --workers N        workers to start, 0..10 (default 2)
#   --pool-nodes N     pool nodes to start, 0..10 (default 2)
#   --num-blocks N     GPU KV blocks per worker (default 512)
#   --dram SIZE        DRAM tier per pool node (default 64MiB)
#   --nvme SIZE        NVMe tier per pool node (default 256MiB)
#   --page-bytes B     pool node page size (default: 32768 for tiny-gqa, else 65536)
#   --policy P         router policy (default cache_aware)
#   --offload MODE     worker --offload (default: the worker's)
#   --fetch MODE       worker --fetch (default: the worker's)
#   --metrics-base P   serve /metrics on P, P+1, ... (router, nodes, workers); default off
#   --wait S           seconds to wait for each process's health (default 30)
set -euo pipefail

usage() { sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; }

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cmd="${1:-}"
[[ $# -gt 0 ]] && shift
RUN_DIR="${KVPOOL_RUN_DIR:-$ROOT/build/local-cluster}"
BIN_DIR="${KVPOOL_BIN_DIR:-$ROOT/build/default}"
BASE_PORT="${KVPOOL_BASE_PORT:-50051}"
MODEL=tiny-gqa
WORKERS=2
POOL_NODES=2
NUM_BLOCKS=512
DRAM=64MiB
NVME=256MiB
PAGE_BYTES=
POLICY=cache_aware
OFFLOAD=
FETCH=
METRICS_BASE=-1
WAIT_S=30

die() { echo "cluster.sh: $*" >&2; exit 2; }
need() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir) need "$@"; RUN_DIR="$2"; shift 2 ;;
    --bin-dir) need "$@"; BIN_DIR="$2"; shift 2 ;;
    --base-port) need "$@"; BASE_PORT="$2"; shift 2 ;;
    --model) need "$@"; MODEL="$2"; shift 2 ;;
    --workers) need "$@"; WORKERS="$2"; shift 2 ;;
    --pool-nodes) need "$@"; POOL_NODES="$2"; shift 2 ;;
    --num-blocks) need "$@"; NUM_BLOCKS="$2"; shift 2 ;;
    --dram) need "$@"; DRAM="$2"; shift 2 ;;
    --nvme) need "$@"; NVME="$2"; shift 2 ;;
    --page-bytes) need "$@"; PAGE_BYTES="$2"; shift 2 ;;
    --policy) need "$@"; POLICY="$2"; shift 2 ;;
    --offload) need "$@"; OFFLOAD="$2"; shift 2 ;;
    --fetch) need "$@"; FETCH="$2"; shift 2 ;;
    --metrics-base) need "$@"; METRICS_BASE="$2"; shift 2 ;;
    --wait) need "$@"; WAIT_S="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done
if ! [[ "$BASE_PORT" =~ ^[0-9]+$ ]] || (( BASE_PORT < 1024 || BASE_PORT > 65500 )); then
  die "--base-port=$BASE_PORT: use a port in 1024..65500"
fi
if ! [[ "$WORKERS" =~ ^[0-9]+$ ]] || (( WORKERS > 10 )); then die "--workers=$WORKERS: use 0..10"; fi
if ! [[ "$POOL_NODES" =~ ^[0-9]+$ ]] || (( POOL_NODES > 10 )); then die "--pool-nodes=$POOL_NODES: use 0..10"; fi
[[ "$METRICS_BASE" =~ ^-?[0-9]+$ ]] || die "--metrics-base=$METRICS_BASE: use a port, or -1 for off"
if ! [[ "$WAIT_S" =~ ^[0-9]+$ ]] || (( WAIT_S < 1 || WAIT_S > 3600 )); then
  die "--wait=$WAIT_S: use whole seconds, 1..3600"
fi
if [[ -z "$PAGE_BYTES" ]]; then
  [[ "$MODEL" == tiny-gqa ]] && PAGE_BYTES=32768 || PAGE_BYTES=65536
fi
[[ "$RUN_DIR" = /* ]] || RUN_DIR="$PWD/$RUN_DIR"
[[ "$BIN_DIR" = /* ]] || BIN_DIR="$PWD/$BIN_DIR"

ROUTER_BIN="$BIN_DIR/router/kvpool-router"
NODE_BIN="$BIN_DIR/pool-node/kvpool-node"
WORKER_BIN="$BIN_DIR/worker/service/kvpool-worker"
KVCTL="$BIN_DIR/router/cli/kvctl"
HOST=127.0.0.1
ROUTER_ADDR="$HOST:$BASE_PORT"

metrics_port() {  # metrics_port <index>
  if (( METRICS_BASE < 0 )); then echo -1; else echo $((METRICS_BASE + $1)); fi
}

# A process we started is named by its pid file; its command line must still name the
# binary (a recycled pid is never signalled).
pid_of() {  # pid_of <name>: prints the pid when the process is alive and ours
  local f="$RUN_DIR/$1.pid" pid exe
  [[ -f "$f" ]] || return 1
  pid="$(cat "$f" 2>/dev/null)" || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  kill -0 "$pid" 2>/dev/null || return 1
  exe="$(head -c 4096 "/proc/$pid/cmdline" 2>/dev/null | tr '\0' ' ')" || return 1
  [[ "$exe" == *kvpool-* ]] || return 1
  # A zombie (exited, not yet reaped) is dead.
  [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]] || return 1
  echo "$pid"
}

# Names in start order, from the manifest the last start wrote.
names() {
  [[ -f "$RUN_DIR/cluster.manifest" ]] && awk '{print $1}' "$RUN_DIR/cluster.manifest"
  return 0
}

stop_one() {  # stop_one <name>
  local name="$1" pid i
  if pid="$(pid_of "$name")"; then
    kill -TERM "$pid" 2>/dev/null || true
    # Up to 20 s for a clean exit: a worker drains its requests for up to 10 s
    # (--drain-timeout-ms), then stops its gRPC server (2 s) and unregisters (1 s).
    for ((i = 0; i < 200; i++)); do
      pid_of "$name" >/dev/null || break
      sleep 0.1
    done
    if pid_of "$name" >/dev/null; then
      echo "cluster.sh: $name (pid $pid) ignored SIGTERM for 20 s; sending SIGKILL" >&2
      kill -KILL "$pid" 2>/dev/null || true
      for ((i = 0; i < 50; i++)); do
        pid_of "$name" >/dev/null || break
        sleep 0.1
      done
    fi
    echo "stopped $name (pid $pid)"
  fi
  rm -f "$RUN_DIR/$name.pid"
}

do_stop() {
  local n list=()
  mapfile -t list < <(names)
  # Reverse start order: workers, then pool nodes, then the router.
  for ((n = ${#list[@]} - 1; n >= 0; n--)); do stop_one "${list[n]}"; done
  # Pid files of processes the manifest does not name (an interrupted start).
  local f
  for f in "$RUN_DIR"/*.pid; do
    [[ -e "$f" ]] || continue
    stop_one "$(basename "$f" .pid)"
  done
}

do_status() {
  [[ -f "$RUN_DIR/cluster.manifest" ]] || { echo "no cluster in $RUN_DIR"; return 3; }
  local name addr pid dead=0
  while read -r name addr; do
    if pid="$(pid_of "$name")"; then
      printf '%-10s %-22s alive (pid %s)  log %s\n' "$name" "$addr" "$pid" "$RUN_DIR/$name.log"
    else
      printf '%-10s %-22s dead                log %s\n' "$name" "$addr" "$RUN_DIR/$name.log"
      dead=1
    fi
  done < "$RUN_DIR/cluster.manifest"
  return $dead
}

fail_start() {  # fail_start <name> <message>
  local name="$1"
  echo "cluster.sh: $name: $2" >&2
  if [[ -f "$RUN_DIR/$name.log" ]]; then
    echo "---- last lines of $RUN_DIR/$name.log ----" >&2
    tail -n 30 "$RUN_DIR/$name.log" >&2
    echo "----" >&2
  fi
  echo "cluster.sh: stopping what was started" >&2
  do_stop >&2
  exit 1
}

launch() {  # launch <name> <address> <binary> args...
  local name="$1" addr="$2" bin="$3"
  shift 3
  [[ -x "$bin" ]] || fail_start "$name" "binary $bin not found; build it (bash scripts/build.sh default)"
  echo "$name $addr" >> "$RUN_DIR/cluster.manifest"
  {
    echo "# $(date -u +%FT%TZ) $bin $*"
  } > "$RUN_DIR/$name.log"
  # stdin from /dev/null; own log. A Ctrl-C while starting runs do_start's trap (`stop`).
  "$bin" "$@" < /dev/null >> "$RUN_DIR/$name.log" 2>&1 &
  echo $! > "$RUN_DIR/$name.pid"
}

# Alive, for a process this shell just started (its command line may still be ours for a
# moment, before exec).
started_alive() {  # started_alive <name>
  local pid
  pid="$(cat "$RUN_DIR/$1.pid" 2>/dev/null)" || return 1
  kill -0 "$pid" 2>/dev/null && [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]]
}

wait_healthy() {  # wait_healthy <name> <address>
  local name="$1" addr="$2" deadline=$((SECONDS + WAIT_S))
  while :; do
    started_alive "$name" || fail_start "$name" "exited during start-up"
    if "$KVCTL" health --addr "$addr" --wait 1 > /dev/null 2>&1; then
      echo "$name $addr SERVING (pid $(cat "$RUN_DIR/$name.pid"))"
      return 0
    fi
    (( SECONDS < deadline )) || break
  done
  # The last try, with the kvctl command the README shows, so its message is printed.
  "$KVCTL" health --addr "$addr" --wait 1 >&2 ||
    fail_start "$name" "not SERVING on $addr after ${WAIT_S} s"
}

port_free() {  # port_free <port>: nothing listens on it
  ! (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null
}

do_start() {
  mkdir -p "$RUN_DIR"
  local n
  for f in "$RUN_DIR"/*.pid; do
    [[ -e "$f" ]] || continue
    n="$(basename "$f" .pid)"
    if pid_of "$n" > /dev/null; then
      die "a cluster is already running in $RUN_DIR ($n); run: $0 stop --dir $RUN_DIR"
    fi
    rm -f "$f"
  done
  [[ -x "$KVCTL" ]] || die "kvctl not found at $KVCTL; build it (bash scripts/build.sh default) or pass --bin-dir"
  if (( WORKERS > 0 )) && [[ ! -x "$WORKER_BIN" ]]; then
    die "kvpool-worker not found at $WORKER_BIN; build it, or start without workers (--workers 0)"
  fi
  local ports=("$BASE_PORT") i
  for ((i = 0; i < POOL_NODES; i++)); do ports+=($((BASE_PORT + 10 + i))); done
  for ((i = 0; i < WORKERS; i++)); do ports+=($((BASE_PORT + 20 + i))); done
  if (( METRICS_BASE >= 0 )); then
    for ((i = 0; i < 1 + POOL_NODES + WORKERS; i++)); do ports+=($(metrics_port "$i")); done
  fi
  for p in "${ports[@]}"; do
    port_free "$p" || die "port $p on $HOST is in use; pick other ports with --base-port or KVPOOL_BASE_PORT"
  done
  rm -f "$RUN_DIR/cluster.manifest"
  echo "kvpool local cluster in $RUN_DIR (binaries from $BIN_DIR, model $MODEL)"
  # Interrupted (Ctrl-C, kill) while starting: stop what was started. The servers run in
  # the background of a non-interactive shell, which ignores SIGINT for them, so nobody
  # else would.
  trap 'echo "cluster.sh: interrupted; stopping what was started" >&2; do_stop >&2; exit 130' INT TERM
  # Any other exit before the cluster is up (an unexpected error under set -e) stops what
  # was started too; fail_start and the trap above have stopped it already.
  trap 'rc=$?; if (( rc != 0 )) && compgen -G "$RUN_DIR/*.pid" > /dev/null; then
          echo "cluster.sh: start failed (exit $rc); stopping what was started" >&2; do_stop >&2; fi' EXIT

  # The router's cost model must know these workers are CPUs computing tiny models
  # (~1e10 FLOP/s effective, attention included), not 400 TFLOP/s GPUs; otherwise it
  # predicts recompute is always cheaper than a pool fetch.
  launch router "$ROUTER_ADDR" "$ROUTER_BIN" --listen "$ROUTER_ADDR" --models "$MODEL" \
    --policy "$POLICY" --metrics-port "$(metrics_port 0)" --flops 1e10
  wait_healthy router "$ROUTER_ADDR"

  local pool_addrs=() name addr letters=(a b c d e f g h i j)
  for ((i = 0; i < POOL_NODES; i++)); do
    name="pool-${letters[i]}"
    addr="$HOST:$((BASE_PORT + 10 + i))"
    rm -rf "$RUN_DIR/nvme-$name"  # a fresh tier each start (sizes may differ)
    mkdir -p "$RUN_DIR/nvme-$name"
    launch "$name" "$addr" "$NODE_BIN" --listen "$addr" --node-id "$name" --dram "$DRAM" \
      --page-bytes "$PAGE_BYTES" --nvme-dir "$RUN_DIR/nvme-$name" --nvme "$NVME" \
      --router "$ROUTER_ADDR" --metrics-port "$(metrics_port $((1 + i)))"
    pool_addrs+=("$addr")
  done
  for ((i = 0; i < POOL_NODES; i++)); do wait_healthy "pool-${letters[i]}" "${pool_addrs[i]}"; done

  local pool_list
  pool_list="$(IFS=,; echo "${pool_addrs[*]}")"
  for ((i = 0; i < WORKERS; i++)); do
    name="worker-$i"
    addr="$HOST:$((BASE_PORT + 20 + i))"
    local args=(--listen "$addr" --instance-id "$name" --model "$MODEL" --num-blocks "$NUM_BLOCKS"
                --router "$ROUTER_ADDR" --metrics-port "$(metrics_port $((1 + POOL_NODES + i)))")
    [[ -n "$pool_list" ]] && args+=(--pool-nodes "$pool_list")
    [[ -n "$OFFLOAD" ]] && args+=(--offload "$OFFLOAD")
    [[ -n "$FETCH" ]] && args+=(--fetch "$FETCH")
    launch "$name" "$addr" "$WORKER_BIN" "${args[@]}"
  done
  for ((i = 0; i < WORKERS; i++)); do wait_healthy "worker-$i" "$HOST:$((BASE_PORT + 20 + i))"; done
  trap - INT TERM EXIT
  echo "cluster up: router $ROUTER_ADDR, ${POOL_NODES} pool node(s), ${WORKERS} worker(s)"
  echo "  $KVCTL status --router $ROUTER_ADDR"
  echo "  $0 stop --dir $RUN_DIR"
}

case "$cmd" in
  start) do_start ;;
  stop) do_stop ;;
  status) do_status ;;
  -h|--help|help) usage ;;
  *) usage >&2; exit 2 ;;
esac

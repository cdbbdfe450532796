#!/usr/bin/env bash
# Run docker-compose.yml for real, end to end, with podman: build the images, `up` the whole arith-tiny run,
# scale RaaS to 3 while it trains, wait until the trainer has finished its steps, read the result from the host
# (the S3 store, the metrics endpoint and a consumer group of its own: scripts/compose_result.py), stop it with
# `stop`/`down -v` and check that no container, network or volume is left. No mock: Kafka, SeaweedFS and every
# AstraFlow component run as the compose file says.
#   scripts/compose_check.sh [--timeout-s S]     (default 3600: the longest wait for the run to finish)
# A slow check (tens of minutes: the AstraFlow image installs requirements/dev.lock, torch among it), so not part
# of .ci/run: run it on a schedule (nightly) and before changing docker-compose.yml, the Dockerfile or what they
# run. It ends with one JSON line:
#   {"metric": "compose", "complete": ..., "raas_replicas": ..., "lost": ..., "reward_first": ..., "reward_last": ...,
#    "wall_s": ..., "build_s": ...}
# and exits 0 only when the run completed (the trainer exited 0 after its steps), 3 RaaS replicas ran, no committed
# prompt was lost, the reward rose, every container stopped cleanly and nothing was left behind.
#
# What this machine lacks, and what stands in (each a machine fact, not a change of the compose file):
# - no container registry is reachable: the images the compose file names are built here under those names
#   (once; kept in podman's storage): python:3.11-slim, the Dockerfile's base, is a Debian bookworm rootfs
#   (debootstrap; Python 3.11) with python3-venv; apache/kafka:4.1.1 is Debian's OpenJDK with Kafka's jars from
#   Maven Central (scripts/compose_images/kafka.Containerfile); chrislusf/seaweedfs:4.53 is SeaweedFS's `weed`
#   built from its Go module at that release (scripts/compose_images/seaweedfs.Containerfile). The AstraFlow
#   image is built from the repository's own Dockerfile, unchanged: its apt-get and its pip/uv installs reach
#   Debian's mirror and PyPI from inside the build.
# - HTTPS leaves this machine through a TLS-inspecting egress whose CA the host trusts: the Debian base above
#   trusts the same CA certificates (scripts/compose_images/base.Containerfile), or PyPI fails TLS in the build.
# - no Docker engine: podman's Docker-compatible API (`podman system service`) serves docker-compose.
# - no systemd (podman schedules healthchecks with systemd timers): this script runs each container's
#   healthcheck (`podman healthcheck run`) every 3 s until it is healthy, so `condition: service_healthy` holds.
# - podman's defaults fail in this sandbox (crun: `setrlimit RLIMIT_NOFILE: Operation not permitted`, `cgroups
#   in hybrid mode not supported`): scripts/compose_images/containers.conf (runc, cgroupfs, lower ulimits) is
#   given to podman through CONTAINERS_CONF.
# - the host may already use the compose file's ports (a broker on 9092): a port in use is replaced by a free
#   one through the compose file's own variables (ASTRAFLOW_KAFKA_PORT, ASTRAFLOW_S3_PORT, ASTRAFLOW_METRICS_PORT).
# Environment: ASTRAFLOW_CACHE (default ~/.cache/astraflow): the rootfs and weed binary are kept under compose/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
timeout_s=3600
while [ $# -gt 0 ]; do
  case "$1" in
    --timeout-s) timeout_s="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "[compose-check] unknown argument '$1' (--timeout-s S, --help)" >&2; exit 2 ;;
  esac
done

PROJECT=astraflow-check
CACHE="${ASTRAFLOW_CACHE:-$HOME/.cache/astraflow}/compose"
ROOTFS=localhost/astraflow-check/debian-rootfs:bookworm
BASE=localhost/astraflow-check/debian:bookworm
KAFKA_IMAGE=docker.io/apache/kafka:4.1.1
S3_IMAGE=docker.io/chrislusf/seaweedfs:4.53
WEED_MODULE=github.com/seaweedfs/seaweedfs@v0.0.0-20261109003541-7506e5f91cd6  # SeaweedFS 4.53
RUN_DIR="$(mktemp -d /tmp/astraflow-compose-check.XXXXXX)"
export CONTAINERS_CONF="$ROOT/scripts/compose_images/containers.conf"
export DOCKER_HOST="unix://$RUN_DIR/podman.sock"
export COMPOSE_PROJECT_NAME="$PROJECT"
t_start=$(date +%s)
log() { echo "[compose-check] $(date -u +%H:%M:%S) $*" >&2; }
compose() { docker-compose -f "$ROOT/docker-compose.yml" "$@"; }

# --- what it needs -------------------------------------------------------------------------------------------
source scripts/apt_install.sh
for tool in podman:podman docker-compose:docker-compose debootstrap:debootstrap runc:runc mvn:maven \
            java:openjdk-17-jre-headless go:golang-go; do
  command -v "${tool%%:*}" >/dev/null || apt_install "${tool#*:}"
  command -v "${tool%%:*}" >/dev/null || { log "${tool%%:*} is missing and could not be installed"; exit 1; }
done
[ -x .venv/bin/python ] || scripts/install.sh dev --lazy-bytecode

# --- the podman service and the healthcheck runner; torn down on exit ------------------------------------------
podman system service --time=0 "$DOCKER_HOST" >"$RUN_DIR/podman-service.log" 2>&1 &
service_pid=$!
health_pid=
teardown() {
  local rc=$?
  if [ -n "${health_pid}" ]; then kill "$health_pid" 2>/dev/null || true; fi
  if [ -S "$RUN_DIR/podman.sock" ] && [ -n "$(podman ps -aq --filter "label=com.docker.compose.project=$PROJECT")" ]; then
    log "tearing down (exit $rc): docker-compose down -v"
    compose down -v --remove-orphans -t 60 >&2 || true
  fi
  kill "$service_pid" 2>/dev/null || true
  wait "$service_pid" 2>/dev/null || true
  rm -rf "$RUN_DIR"
  exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT TERM
for _ in $(seq 1 50); do [ -S "$RUN_DIR/podman.sock" ] && break; sleep 0.2; done
[ -S "$RUN_DIR/podman.sock" ] || { log "podman system service did not start: $(cat "$RUN_DIR/podman-service.log")"; exit 1; }
if [ -n "$(podman ps -aq --filter "label=com.docker.compose.project=$PROJECT")" ]; then
  log "containers of an earlier check are left: removing them"
  compose down -v --remove-orphans -t 10 >&2 || true
fi

# --- images -----------------------------------------------------------------------------------------------------
t_build=$(date +%s)
mkdir -p "$CACHE"
image_exists() { podman image exists "$1"; }
if ! image_exists "$ROOTFS"; then
  if [ ! -f "$CACHE/bookworm.tar" ]; then
    log "Debian bookworm rootfs by debootstrap (minbase, python3, python3-venv)"
    rm -rf "$CACHE/rootfs"
    debootstrap --variant=minbase --include=ca-certificates,python3,python3-venv bookworm "$CACHE/rootfs" \
        http://deb.debian.org/debian >"$CACHE/debootstrap.log" 2>&1 \
      || { log "debootstrap failed; see $CACHE/debootstrap.log"; exit 1; }
    rm -rf "$CACHE/rootfs/var/cache/apt/archives/"*.deb "$CACHE/rootfs/var/lib/apt/lists/"*
    tar -C "$CACHE/rootfs" -cf "$CACHE/bookworm.tar.tmp" . && mv "$CACHE/bookworm.tar.tmp" "$CACHE/bookworm.tar"
    rm -rf "$CACHE/rootfs"
  fi
  podman import "$CACHE/bookworm.tar" "$ROOTFS" >/dev/null
fi
if ! image_exists "$BASE"; then
  log "$BASE: the rootfs, trusting this machine's CA certificates"
  ctx="$RUN_DIR/base-context"
  mkdir -p "$ctx/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$ctx/ca-certificates/" 2>/dev/null || true
  podman build -q --build-arg "ROOTFS=$ROOTFS" -f scripts/compose_images/base.Containerfile -t "$BASE" "$ctx" >/dev/null
fi
if ! image_exists docker.io/library/python:3.11-slim; then
  log "python:3.11-slim: the Debian bookworm base (Python 3.11, /usr/bin/python3)"
  podman tag "$BASE" docker.io/library/python:3.11-slim
fi
if ! image_exists "$KAFKA_IMAGE"; then
  log "$KAFKA_IMAGE from Kafka's jars on Maven Central"
  ctx="$RUN_DIR/kafka-context"
  mkdir -p "$ctx"
  cp -r "$(scripts/kafka-local.sh fetch)" "$ctx/libs"
  cp scripts/compose_images/kafka-run.sh scripts/compose_images/kafka-topics.sh "$ctx/"
  podman build -q --build-arg "BASE=$BASE" -f scripts/compose_images/kafka.Containerfile -t "$KAFKA_IMAGE" "$ctx" >/dev/null
fi
if ! image_exists "$S3_IMAGE"; then
  weed="$CACHE/weed-${WEED_MODULE#*@}"
  if [ ! -x "$weed" ]; then
    log "SeaweedFS's weed from the Go module $WEED_MODULE (a few minutes of compiling)"
    dir="$(GOFLAGS=-mod=mod go mod download -json "$WEED_MODULE" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')"
    # built in the module's own directory: its go.mod has replace directives, which `go install m@v` refuses
    (cd "$dir" && CGO_ENABLED=0 nice -n 10 go build -o "$weed.tmp" ./weed) && mv "$weed.tmp" "$weed"
  fi
  ctx="$RUN_DIR/seaweedfs-context"
  mkdir -p "$ctx"
  cp "$weed" "$ctx/weed"
  podman build -q --build-arg "BASE=$BASE" -f scripts/compose_images/seaweedfs.Containerfile -t "$S3_IMAGE" "$ctx" >/dev/null
fi
log "astraflow:cpu from the repository's Dockerfile"
t_astraflow=$(date +%s)
nice -n 10 podman build -t localhost/astraflow:cpu . >"$RUN_DIR/build.log" 2>&1 \
  || { tail -n 40 "$RUN_DIR/build.log" >&2; log "the AstraFlow image did not build"; exit 1; }
t_built=$(date +%s)
build_s=$((t_built - t_build))
log "images built in ${build_s} s (astraflow:cpu $((t_built - t_astraflow)) s; $(podman image inspect --format '{{.Size}}' localhost/astraflow:cpu | awk '{printf "%.1f GB", $1/1e9}'))"

# --- ports ------------------------------------------------------------------------------------------------------
free_port() {  # the default port when it is free, else one the kernel hands out
  if .venv/bin/python -c "import socket,sys; s=socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1])))" "$1" 2>/dev/null; then
    echo "$1"
  else
    .venv/bin/python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
  fi
}
export ASTRAFLOW_KAFKA_PORT ASTRAFLOW_S3_PORT ASTRAFLOW_METRICS_PORT
ASTRAFLOW_KAFKA_PORT=$(free_port 9092)
ASTRAFLOW_S3_PORT=$(free_port 8333)
ASTRAFLOW_METRICS_PORT=$(free_port 9400)
log "host ports: Kafka $ASTRAFLOW_KAFKA_PORT, S3 $ASTRAFLOW_S3_PORT, metrics $ASTRAFLOW_METRICS_PORT"

# --- healthchecks (no systemd to schedule them) -------------------------------------------------------------------
run_healthchecks() {
  while :; do
    for id in $(podman ps -q --filter "label=com.docker.compose.project=$PROJECT" --filter health=starting); do
      podman healthcheck run "$id" >/dev/null 2>&1 || true
    done
    sleep 3
  done
}
run_healthchecks &
health_pid=$!

# --- the run ------------------------------------------------------------------------------------------------------
inventory() {  # every container, network and volume podman has (anonymous volumes carry no compose label)
  { podman ps -aq; podman network ls -q; podman volume ls -q; } | sort
}
inventory >"$RUN_DIR/before"
t_up=$(date +%s)
log "docker-compose up -d"
compose up -d --no-build >&2
container_of() { compose ps -q "$1" | head -n 1; }
state() { podman inspect --format '{{.State.Status}} {{.State.ExitCode}}' "$1"; }
metric() {  # the newest value of a metric line matching $1 on the metrics endpoint, or nothing
  curl -fsS "http://127.0.0.1:$ASTRAFLOW_METRICS_PORT/metrics" 2>/dev/null | grep -E "^$1" | tail -n 1 | awk '{print $NF}'
}
scaled=0
raas_replicas=0
trainer_rc=
while :; do
  now=$(date +%s)
  if [ $((now - t_up)) -gt "$timeout_s" ]; then log "the run did not finish in $timeout_s s"; break; fi
  trainer=$(container_of trainer)
  if [ -n "$trainer" ]; then
    read -r status code < <(state "$trainer")
    if [ "$status" = exited ] && [ "$code" = 0 ]; then trainer_rc=0; break; fi
  fi
  version=$(metric 'astraflow_durable_version\{' || true)
  if [ "$scaled" = 0 ] && [ -n "$version" ] && [ "${version%.*}" -ge 40 ]; then
    log "trainer at version ${version%.*}: docker-compose up -d --scale raas=3"
    compose up -d --no-build --no-deps --scale raas=3 raas >&2
    scaled=1
  fi
  running=$(compose ps -q raas | while read -r id; do state "$id"; done | grep -c '^running' || true)
  [ "$running" -gt "$raas_replicas" ] && raas_replicas=$running
  if [ $(((now - t_up) % 60)) -lt 5 ]; then log "$((now - t_up)) s: trainer version ${version:-none}, $running RaaS running"; fi
  sleep 5
done
run_s=$(( $(date +%s) - t_up ))
log "run finished in $run_s s (trainer exit code ${trainer_rc:-none})"
compose ps >&2

# --- the result, from the host ------------------------------------------------------------------------------------
AWS_ACCESS_KEY_ID=astraflow AWS_SECRET_ACCESS_KEY=astraflow-secret AWS_REGION=us-east-1 \
  .venv/bin/python scripts/compose_result.py --bootstrap "127.0.0.1:$ASTRAFLOW_KAFKA_PORT" \
  --s3 "http://127.0.0.1:$ASTRAFLOW_S3_PORT" --metrics "http://127.0.0.1:$ASTRAFLOW_METRICS_PORT/metrics" \
  >"$RUN_DIR/result.out" || true
cat "$RUN_DIR/result.out" >&2
result="$(tail -n 1 "$RUN_DIR/result.out")"

# --- shutdown -----------------------------------------------------------------------------------------------------
log "docker-compose stop (SIGTERM; SIGKILL after each service's stop_grace_period, as for a user's down)"
t_stop=$(date +%s)
compose stop >&2
stop_s=$(( $(date +%s) - t_stop ))
stopped=$(for id in $(compose ps -q); do
  printf '%s %s %s\n' "$(podman inspect --format '{{.Name}}' "$id")" "$(state "$id")" \
    "$(date -d "$(podman inspect --format '{{.State.FinishedAt}}' "$id" | cut -d' ' -f1,2)" +%s)"; done)
echo "$stopped" | awk -v t="$t_stop" '$4 >= t {printf "  %s exit %s after %d s\n", $1, $3, $4 - t}' >&2
unclean=$(echo "$stopped" | awk '$3 != 0 && !($3 == 143 && $1 ~ /_kafka_/) {print $1 " exit " $3}')  # Kafka's JVM: 143
log "stopped in $stop_s s; $([ -z "$unclean" ] && echo "every container exited on the SIGTERM (0, or 143 for Kafka's JVM)" || echo "not clean: $unclean")"
compose down -v --remove-orphans -t 60 >&2
left="$(inventory | comm -13 "$RUN_DIR/before" - | tr '\n' ' ')"
[ -z "$left" ] && log "down -v left no container, network or volume" || log "left behind: $left"

wall_s=$(( $(date +%s) - t_start ))
.venv/bin/python - "$result" "$trainer_rc" "$raas_replicas" "$wall_s" "$build_s" "$run_s" "$stop_s" "$unclean" "$left" <<'PY'
import json, sys
result, trainer_rc, replicas, wall_s, build_s, run_s, stop_s, unclean, left = sys.argv[1:]
try:
    r = json.loads(result)
except ValueError:
    r = {}
out = {"metric": "compose", "complete": trainer_rc == "0" and r.get("versions", [0, 0])[1] >= 400,
       "raas_replicas": int(replicas), "lost": r.get("lost"), "reward_first": r.get("reward_first"),
       "reward_last": r.get("reward_last"), "wall_s": int(wall_s), "build_s": int(build_s), "run_s": int(run_s),
       "stop_s": int(stop_s), "clean_stop": not unclean, "left": not not left}
print(json.dumps(out))
ok = (out["complete"] and out["raas_replicas"] >= 3 and out["lost"] == 0 and out["clean_stop"] and not left
      and r.get("trained_twice") == 0 and r.get("group_committed", 0) > 0
      and None not in (out["reward_first"], out["reward_last"]) and out["reward_last"] > out["reward_first"])
sys.exit(0 if ok else 1)
PY

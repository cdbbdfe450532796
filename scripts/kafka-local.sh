#!/usr/bin/env bash
# Start, stop or query a single-node Apache Kafka broker (KRaft: broker and
# controller in one JVM) on 127.0.0.1, fetched from Maven Central with mvn.
# No docker needed.
#
#   scripts/kafka-local.sh start|stop|status
#
# Environment:
#   KAFKA_PORT      broker port (default 9092); the controller uses KAFKA_PORT+1
#   KAFKA_VERSION   Apache Kafka version (default 4.1.1)
#   ASTRAFLOW_CACHE cache root (default ~/.cache/astraflow)
set -euo pipefail

PORT="${KAFKA_PORT:-9092}"
CPORT=$((PORT + 1))
VERSION="${KAFKA_VERSION:-4.1.1}"
CACHE="${ASTRAFLOW_CACHE:-$HOME/.cache/astraflow}"
HOME_DIR="$CACHE/kafka-$VERSION"
LIBS="$HOME_DIR/libs"
STATE="$CACHE/kafka-state-$PORT"
PIDFILE="$STATE/kafka.pid"
LOG="$STATE/kafka.log"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

log() { echo "[kafka-local] $*" >&2; }

fetch() {
  if [ -f "$LIBS/.complete" ]; then return 0; fi
  command -v mvn >/dev/null || { log "mvn not found: install Maven (and Java 17+)"; exit 1; }
  log "fetching Apache Kafka $VERSION from Maven Central into $LIBS"
  mkdir -p "$LIBS"
  mvn -q -B -f "$HERE/kafka/pom.xml" -Dkafka.version="$VERSION" \
      dependency:copy-dependencies -DoutputDirectory="$LIBS" -DincludeScope=runtime
  touch "$LIBS/.complete"
}

running() {
  [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null
}

ready() {
  # A metadata request that succeeds means the broker is serving.
  java -cp "$LIBS/*" org.apache.kafka.tools.TopicCommand \
      --bootstrap-server "127.0.0.1:$PORT" --list >/dev/null 2>&1
}

start() {
  if running; then log "already running (pid $(cat "$PIDFILE")) on 127.0.0.1:$PORT"; return 0; fi
  fetch
  mkdir -p "$STATE"
  local props="$STATE/server.properties"
  cat > "$props" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:$CPORT
listeners=PLAINTEXT://127.0.0.1:$PORT,CONTROLLER://127.0.0.1:$CPORT
advertised.listeners=PLAINTEXT://127.0.0.1:$PORT
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$STATE/data
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=1000
log.retention.check.interval.ms=5000
log.cleaner.backoff.ms=1000
auto.create.topics.enable=true
PROPS
  if [ ! -f "$STATE/data/meta.properties" ]; then
    log "formatting storage in $STATE/data"
    java -cp "$LIBS/*" kafka.tools.StorageTool format --standalone \
        -t "$(java -cp "$LIBS/*" kafka.tools.StorageTool random-uuid)" \
        -c "$props" >/dev/null
  fi
  log "starting broker on 127.0.0.1:$PORT (log: $LOG)"
  nohup java -Xms256m -Xmx1g -cp "$LIBS/*" kafka.Kafka "$props" >"$LOG" 2>&1 &
  echo $! > "$PIDFILE"
  for _ in $(seq 1 120); do
    if ready; then log "ready on 127.0.0.1:$PORT"; return 0; fi
    if ! running; then log "broker died; last log lines:"; tail -n 30 "$LOG" >&2; exit 1; fi
    sleep 1
  done
  log "broker did not become ready in 120 s; see $LOG"; exit 1
}

stop() {
  if ! running; then log "not running (no live pid in $PIDFILE)"; rm -f "$PIDFILE"; return 0; fi
  local pid; pid="$(cat "$PIDFILE")"
  log "stopping pid $pid"
  kill "$pid"
  for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || { rm -f "$PIDFILE"; return 0; }; sleep 1; done
  kill -9 "$pid" 2>/dev/null || true; rm -f "$PIDFILE"
}

status() {
  if running && ready; then echo "running pid $(cat "$PIDFILE") on 127.0.0.1:$PORT"; return 0; fi
  if running; then echo "starting pid $(cat "$PIDFILE") (not ready yet)"; return 1; fi
  echo "stopped"; return 3
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac

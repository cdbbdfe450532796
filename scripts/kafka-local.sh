#!/usr/bin/env bash
# Start, stop or query a single-node Apache Kafka broker (KRaft: broker and
# controller in one JVM) on 127.0.0.1, fetched from Maven Central with mvn.
# No docker needed.
#
#   scripts/kafka-local.sh start [--fresh]|stop|status|secure-env|fetch
#
# `fetch` only fetches the jars (once) and prints their directory (scripts/compose_check.sh builds its Kafka
# image from them).
# `start --fresh` starts with an empty data directory (no topic, no group of earlier runs; the CA, the
# certificates and the SCRAM password are kept), and is refused while the broker runs. The test suite's
# brokers start so: a data directory kept across runs had grown to ~14,000 partitions, every one loaded at
# start and listed in every metadata answer, and a topic created under load waited over 30 s for its leader.
#
# The broker listens twice: PLAINTEXT on KAFKA_PORT, and SASL_SSL (SCRAM-SHA-512
# over TLS) on KAFKA_PORT+2, with a CA and a broker certificate made here by
# openssl and a user `astraflow` whose random password is kept in the state
# directory (mode 600). `secure-env` prints the ASTRAFLOW_KAFKA_* variables
# (and ASTRAFLOW_SECURE_BOOTSTRAP) that point AstraFlow at that listener:
#   set -a; eval "$(scripts/kafka-local.sh secure-env)"; set +a
#
# Environment:
#   KAFKA_PORT      broker port (default 9092); the controller uses KAFKA_PORT+1,
#                   the SASL_SSL listener KAFKA_PORT+2
#   KAFKA_VERSION   Apache Kafka version (default 4.1.1)
#   ASTRAFLOW_CACHE cache root (default ~/.cache/astraflow)
set -euo pipefail

PORT="${KAFKA_PORT:-9092}"
CPORT=$((PORT + 1))
SPORT=$((PORT + 2))
VERSION="${KAFKA_VERSION:-4.1.1}"
CACHE="${ASTRAFLOW_CACHE:-$HOME/.cache/astraflow}"
HOME_DIR="$CACHE/kafka-$VERSION"
LIBS="$HOME_DIR/libs"
STATE="$CACHE/kafka-state-$PORT"
PIDFILE="$STATE/kafka.pid"
LOG="$STATE/kafka.log"
SECURE="$STATE/secure"
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

# A CA, a broker certificate for 127.0.0.1/localhost signed by it (PKCS#12 for the broker, the CA as PEM
# for clients) and the SCRAM user's password; made once per state directory.
secure_material() {
  if [ -f "$SECURE/.complete" ]; then return 0; fi
  command -v openssl >/dev/null || { log "openssl not found: needed for the SASL_SSL listener's certificates"; exit 1; }
  log "making a CA, a broker certificate and SCRAM credentials in $SECURE"
  rm -rf "$SECURE"; mkdir -p "$SECURE"; chmod 700 "$SECURE"
  (
    cd "$SECURE"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=astraflow-local-ca" \
        -keyout ca.key -out ca.pem 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout broker.key -out broker.csr 2>/dev/null
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' > san.ext
    openssl x509 -req -in broker.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 3650 \
        -extfile san.ext -out broker.pem 2>/dev/null
    openssl rand -hex 16 > keystore.password
    openssl pkcs12 -export -in broker.pem -inkey broker.key -name broker -out broker.p12 \
        -passout "file:keystore.password"
    openssl rand -hex 24 > astraflow.password
    chmod 600 ./*
  )
  touch "$SECURE/.complete"
}

# SCRAM credentials live in the cluster metadata: (re)set them over the PLAINTEXT listener on every start.
add_scram_user() {
  java -cp "$LIBS/*" kafka.admin.ConfigCommand --bootstrap-server "127.0.0.1:$PORT" --alter \
      --add-config "SCRAM-SHA-512=[password=$(cat "$SECURE/astraflow.password")]" \
      --entity-type users --entity-name astraflow >/dev/null
}

secure_env() {
  [ -f "$SECURE/.complete" ] || { log "no SASL_SSL material in $SECURE: start the broker first"; exit 1; }
  echo "ASTRAFLOW_SECURE_BOOTSTRAP=127.0.0.1:$SPORT"
  echo "ASTRAFLOW_KAFKA_SECURITY_PROTOCOL=SASL_SSL"
  echo "ASTRAFLOW_KAFKA_SASL_MECHANISM=SCRAM-SHA-512"
  echo "ASTRAFLOW_KAFKA_SASL_USERNAME=astraflow"
  echo "ASTRAFLOW_KAFKA_SASL_PASSWORD=$(cat "$SECURE/astraflow.password")"
  echo "ASTRAFLOW_KAFKA_SSL_CA_LOCATION=$SECURE/ca.pem"
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
  if running; then
    if [ "${1:-}" = "--fresh" ]; then log "refusing start --fresh: a broker runs (pid $(cat "$PIDFILE")) on 127.0.0.1:$PORT"; exit 1; fi
    log "already running (pid $(cat "$PIDFILE")) on 127.0.0.1:$PORT"; return 0
  fi
  case "${1:-}" in
    "") ;;
    --fresh) log "emptying the data directory $STATE/data"; rm -rf "$STATE/data" ;;
    *) log "unknown start option: $1 (known: --fresh)"; exit 2 ;;
  esac
  fetch
  mkdir -p "$STATE"
  secure_material
  local props="$STATE/server.properties"
  ( umask 077; : > "$props" )  # it holds the keystore password
  cat > "$props" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:$CPORT
listeners=PLAINTEXT://127.0.0.1:$PORT,CONTROLLER://127.0.0.1:$CPORT,SASL_SSL://127.0.0.1:$SPORT
advertised.listeners=PLAINTEXT://127.0.0.1:$PORT,SASL_SSL://127.0.0.1:$SPORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_SSL:SASL_SSL
sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
ssl.keystore.type=PKCS12
ssl.keystore.location=$SECURE/broker.p12
ssl.keystore.password=$(cat "$SECURE/keystore.password")
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
    if ready; then
      add_scram_user
      log "ready on 127.0.0.1:$PORT (PLAINTEXT) and 127.0.0.1:$SPORT (SASL_SSL, SCRAM-SHA-512: $0 secure-env)"
      return 0
    fi
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
  start) start "${2:-}" ;;
  stop) stop ;;
  status) status ;;
  secure-env) secure_env ;;
  fetch) fetch; echo "$LIBS" ;;
  *) echo "usage: $0 start [--fresh]|stop|status|secure-env|fetch" >&2; exit 2 ;;
esac

#!/bin/sh
# Entrypoint of the local stand-in for the apache/kafka image (scripts/compose_check.sh builds it from Kafka's
# Maven artifacts): the same interface docker-compose.yml uses. Every KAFKA_<NAME> variable becomes the broker
# property <name> (lower case, `_` -> `.`); the storage is formatted on the first start with CLUSTER_ID; the
# broker then runs in the foreground as PID 1 (SIGTERM: a controlled shutdown).
set -eu
props=/opt/kafka/config/server.properties
mkdir -p /opt/kafka/config
: > "$props"
env | grep '^KAFKA_' | grep -v '^KAFKA_\(HEAP_OPTS\|OPTS\)=' | while IFS='=' read -r key value; do
  echo "$(echo "${key#KAFKA_}" | tr 'A-Z_' 'a-z.')=$value" >> "$props"
done
grep -q '^log\.dirs=' "$props" || echo "log.dirs=/var/lib/kafka/data" >> "$props"
java -cp '/opt/kafka/libs/*' kafka.tools.StorageTool format --ignore-formatted \
    -t "${CLUSTER_ID:-5L6g3nShT-eMCtK--X86sw}" -c "$props" >/dev/null
exec java ${KAFKA_HEAP_OPTS:--Xms256m -Xmx1g} -cp '/opt/kafka/libs/*' kafka.Kafka "$props"

#!/bin/sh
# /opt/kafka/bin/kafka-topics.sh of the local apache/kafka stand-in: Kafka's topic tool.
exec java -Xmx256m -cp '/opt/kafka/libs/*' org.apache.kafka.tools.TopicCommand "$@"

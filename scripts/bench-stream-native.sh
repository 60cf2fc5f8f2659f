#!/usr/bin/env bash
# How fast a client takes a RabbitMQ stream in: AMQP 0-9-1 (what delayd's
# stream ingress speaks) against the native stream protocol (plugin
# rabbitmq_stream on 127.0.0.1:5552, which scripts/rabbitmq.sh enables on
# its single node), through tools/stream-native-bench (its own workspace,
# so the test command never builds it). A benchmark, not a test (issue #37).
#
#   bash scripts/bench-stream-native.sh            # 200,000 messages of 256 B, 2 runs
#   COUNT=500000 RUNS=3 bash scripts/bench-stream-native.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/rabbitmq.sh >/dev/null
bash scripts/build-deps.sh
(cd tools/stream-native-bench && cargo build --release --quiet)
exec tools/stream-native-bench/target/release/stream-native-bench \
    --count "${COUNT:-200000}" --runs "${RUNS:-2}" --body-bytes "${BODY_BYTES:-256}"

#!/usr/bin/env bash
# The test command: starts the brokers the integration tests need (RabbitMQ,
# and Apache Kafka in KRaft mode), then runs every test in the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/rabbitmq.sh
bash scripts/kafka.sh
cargo test --workspace --all-features --no-fail-fast -- --test-threads=2 "$@"

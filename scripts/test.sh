#!/usr/bin/env bash
# The test command: starts the brokers the integration tests need (RabbitMQ:
# the single node, the TLS node and the three-node cluster; Apache Kafka in
# KRaft mode with its TLS listeners), runs every test in the workspace, then the
# short fault campaigns (scripts/faults.sh --short: a few cycles of each fault
# under load, every message accounted for; scripts/cluster-faults.sh --short:
# a node of the three-node cluster killed or restarted under load). Arguments go to the test
# binaries, and then the fault campaign is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO=sudo
bash scripts/build-deps.sh
bash scripts/tls.sh
bash scripts/rabbitmq.sh
RABBITMQ=tls bash scripts/rabbitmq.sh
RABBITMQ=cluster bash scripts/rabbitmq.sh
bash scripts/kafka.sh
# docker-compose (v1, from Debian) validates docker-compose.yml; it needs no
# Docker engine for `config`.
if ! command -v docker-compose >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -qq docker-compose >/dev/null 2>&1 ||
        { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq docker-compose >/dev/null; }
fi
# ss (iproute2) cuts a connection at once in an integration test (`ss -K`);
# iptables cuts one while it stays open (a fresh Debian has neither binary).
if ! command -v ss >/dev/null || ! command -v iptables >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -qq iproute2 iptables >/dev/null 2>&1 ||
        { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq iproute2 iptables >/dev/null; }
fi
cargo test --workspace --all-features --no-fail-fast -- --test-threads=2 "$@"
if [ "$#" -eq 0 ]; then
    python3 scripts/faults/report_test.py  # the campaigns' verdict can fail
    bash scripts/deploy-check.sh   # chart, alert rules, dashboard, status page, image
    bash scripts/faults.sh --short
    bash scripts/cluster-faults.sh --short  # node kills and restarts under the broker-kept store
fi

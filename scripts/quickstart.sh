#!/usr/bin/env bash
# Quick start: run delayd with the plugin drop-in example against the local
# RabbitMQ, publish a few delayed messages and watch them arrive on time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/rabbitmq.sh
bash scripts/build-deps.sh
cargo build --release --quiet
BIN=target/release/delayd

WORK=$(mktemp -d)
trap 'kill $PID 2>/dev/null || true; wait $PID 2>/dev/null || true; rm -rf "$WORK"' EXIT
echo "== starting delayd (config/examples/rabbitmq-plugin-dropin.toml, WAL in $WORK)"
DELAYD_WAL__DIR="$WORK/wal" $BIN run --config config/examples/rabbitmq-plugin-dropin.toml &
PID=$!
for _ in $(seq 1 50); do
    curl -fsS http://127.0.0.1:9464/healthz >/dev/null 2>&1 && break
    sleep 0.2
done

echo "== publishing 20 messages to exchange orders.delayed with x-delay 2-5 s;"
echo "   consuming queue quickstart.orders, bound to the target exchange orders"
$BIN bench --exchange orders.delayed --routing-key order.created \
    --queue quickstart.orders --bind-to orders \
    --count 20 --rate 10 --delay-min 2000 --delay-max 5000 --drain-timeout 20s

echo "== delayd metrics"
curl -fsS http://127.0.0.1:9464/metrics | grep -E '^delayd_(scheduled|fired)_total|^delayd_pending_messages' || true
echo "== stopping delayd with SIGTERM"
kill -TERM $PID
wait $PID
echo "== done: delayd exited cleanly"

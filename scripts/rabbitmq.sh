#!/usr/bin/env bash
# Make sure a RabbitMQ broker listens on 127.0.0.1:5672 (guest/guest).
# Installs rabbitmq-server with apt when it is missing, then starts it.
set -euo pipefail

port_open() { (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; }

if port_open; then
    echo "rabbitmq: already listening on 127.0.0.1:5672"
    exit 0
fi

if ! command -v rabbitmq-server >/dev/null 2>&1; then
    echo "rabbitmq: installing rabbitmq-server with apt"
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq rabbitmq-server >/dev/null
fi

echo "rabbitmq: starting rabbitmq-server"
rabbitmq-server -detached || true
for _ in $(seq 1 120); do
    if port_open; then
        rabbitmqctl await_startup >/dev/null 2>&1 || true
        echo "rabbitmq: up"
        exit 0
    fi
    sleep 1
done
echo "rabbitmq: did not start within 120 s" >&2
exit 1

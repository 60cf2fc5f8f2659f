#!/usr/bin/env bash
# The system libraries delayd's build links: OpenSSL (librdkafka's TLS and
# SASL, rdkafka's `ssl` feature), found with pkg-config. Installed with apt
# when missing; nothing is done when they are there.
set -euo pipefail
if pkg-config --exists openssl 2>/dev/null; then
    exit 0
fi
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO=sudo
echo "build-deps: installing libssl-dev and pkg-config with apt"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -qq libssl-dev pkg-config >/dev/null 2>&1 ||
    { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libssl-dev pkg-config >/dev/null; }

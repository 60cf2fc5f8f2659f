#!/usr/bin/env bash
# The system libraries delayd's build links, found with pkg-config: OpenSSL
# (librdkafka's TLS and SASL, rdkafka's `ssl` feature) and libcurl
# (OAUTHBEARER with an OIDC token endpoint, rdkafka's `curl` feature).
# Installed with apt when missing; nothing is done when they are there.
set -euo pipefail
if pkg-config --exists openssl libcurl 2>/dev/null; then
    exit 0
fi
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO=sudo
echo "build-deps: installing libssl-dev, libcurl4-openssl-dev and pkg-config with apt"
export DEBIAN_FRONTEND=noninteractive
packages="libssl-dev libcurl4-openssl-dev pkg-config"
# shellcheck disable=SC2086
$SUDO apt-get install -y -qq $packages >/dev/null 2>&1 ||
    { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq $packages >/dev/null; }

#!/usr/bin/env bash
# The delayd container image without a Docker engine: buildah assembles it
# from a Debian bookworm root made with debootstrap (once per machine, in
# $IMAGE_ROOT) and a delayd binary, writes it to an image archive, and
# podman loads it. The layout is the Dockerfile's: uid/gid 10001, the
# binary stripped in /usr/local/bin, /etc/delayd/delayd.toml, the WAL in
# /var/lib/delayd/wal (a VOLUME), `delayd healthcheck` as the HEALTHCHECK,
# no curl. The Dockerfile stays the recipe for registries.
#
#   scripts/image.sh [BINARY]     default: target/release/delayd
#   scripts/image.sh --root-only  only make the base root (once per machine)
#
# Environment: IMAGE (localhost/delayd:dev), IMAGE_ROOT
# (/var/tmp/delayd-image-root-bookworm), IMAGE_MIRROR
# (http://deb.debian.org/debian), IMAGE_ARCHIVE (where the archive is
# written; default a temporary file, removed after the load). Needs root
# (debootstrap, buildah mount); installs buildah, podman and debootstrap
# with apt when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT_ONLY=0
[ "${1:-}" = --root-only ] && ROOT_ONLY=1 && shift
BIN=${1:-target/release/delayd}
IMAGE=${IMAGE:-localhost/delayd:dev}
ROOT=${IMAGE_ROOT:-/var/tmp/delayd-image-root-bookworm}
MIRROR=${IMAGE_MIRROR:-http://deb.debian.org/debian}

say() { echo "image.sh: $*" >&2; }
die() { say "$*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "needs root (debootstrap and buildah mount)"
[ "$ROOT_ONLY" = 1 ] || [ -x "$BIN" ] || die "no delayd binary at $BIN (cargo build --release, or give one)"

need=()
for tool in buildah podman debootstrap; do command -v "$tool" >/dev/null || need+=("$tool"); done
if [ "${#need[@]}" -gt 0 ]; then
    say "installing ${need[*]} with apt"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1 ||
        { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; }
fi

# The base root: Debian bookworm minbase, CA certificates (for amqps and
# Kafka over TLS), and the libraries the binary links (librdkafka's TLS,
# SASL and OIDC: libssl3, libcurl4, as the Dockerfile installs). Made once
# per machine, again when this list changes.
PACKAGES="ca-certificates,libssl3,libcurl4"
if [ "$(cat "$ROOT/.delayd-root-ready" 2>/dev/null)" != "$PACKAGES" ]; then
    [ -e "$ROOT" ] && rm -rf --one-file-system "$ROOT"
    partial="$ROOT.partial"
    rm -rf --one-file-system "$partial"
    mkdir -p "$(dirname "$ROOT")"
    t0=$SECONDS
    say "building $ROOT: debootstrap --variant=minbase --include=$PACKAGES bookworm (once per machine)"
    if ! debootstrap --variant=minbase --include="$PACKAGES" bookworm "$partial" "$MIRROR" >"$ROOT.debootstrap.log" 2>&1; then
        tail -n 20 "$ROOT.debootstrap.log" >&2
        die "debootstrap failed (log: $ROOT.debootstrap.log)"
    fi
    # What a container image does without: package caches, docs, apt lists.
    rm -rf "$partial"/var/cache/apt/archives/*.deb "$partial"/var/lib/apt/lists/* \
        "$partial"/usr/share/doc/* "$partial"/usr/share/man/* "$partial"/usr/share/info/*
    echo "$PACKAGES" >"$partial/.delayd-root-ready"
    mv "$partial" "$ROOT"
    say "root built in $((SECONDS - t0)) s"
fi
[ "$ROOT_ONLY" = 0 ] || exit 0

t0=$SECONDS
# Docker's image format: the OCI image config has no HEALTHCHECK.
export BUILDAH_FORMAT=docker
ctr=$(buildah from --quiet scratch)
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
mnt=$(buildah mount "$ctr")
tar -C "$ROOT" --exclude=./.delayd-root-ready --exclude=./proc/* --exclude=./sys/* --exclude=./dev/* -cf - . | tar -C "$mnt" -xf -
# The user, as the Dockerfile makes it (numeric, so runAsNonRoot can check it).
grep -q '^delayd:' "$mnt/etc/group" || echo 'delayd:x:10001:' >>"$mnt/etc/group"
grep -q '^delayd:' "$mnt/etc/passwd" ||
    echo 'delayd:x:10001:10001::/var/lib/delayd:/usr/sbin/nologin' >>"$mnt/etc/passwd"
install -d -o 10001 -g 10001 "$mnt/var/lib/delayd" "$mnt/var/lib/delayd/wal"
install -d "$mnt/etc/delayd"
install -m 644 config/delayd.toml "$mnt/etc/delayd/delayd.toml"
install -m 755 "$BIN" "$mnt/usr/local/bin/delayd"
strip --strip-all "$mnt/usr/local/bin/delayd"
buildah unmount "$ctr" >/dev/null
buildah config \
    --user 10001:10001 \
    --env DELAYD_CONFIG=/etc/delayd/delayd.toml \
    --env DELAYD_WAL__DIR=/var/lib/delayd/wal \
    --volume /var/lib/delayd \
    --port 9464 \
    --entrypoint '["delayd"]' --cmd run \
    --healthcheck 'CMD delayd healthcheck --timeout 2s' \
    --healthcheck-interval 10s --healthcheck-timeout 3s --healthcheck-start-period 30s \
    --label org.opencontainers.image.title=delayd \
    --label "org.opencontainers.image.version=$("$BIN" --version | awk '{print $2}')" \
    "$ctr"
archive=${IMAGE_ARCHIVE:-$(mktemp -u /var/tmp/delayd-image.XXXXXX.tar)}
buildah commit --quiet --format docker --rm "$ctr" "docker-archive:$archive:$IMAGE" >/dev/null
trap - EXIT
podman load --quiet -i "$archive" >/dev/null
[ -n "${IMAGE_ARCHIVE:-}" ] || rm -f "$archive"
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
say "built and loaded $IMAGE in $((SECONDS - t0)) s ($((size / 1048576)) MiB; binary $(($(stat -c %s "$BIN") / 1048576)) MiB before strip)"

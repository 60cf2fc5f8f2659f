#!/usr/bin/env bash
# The deployment checks of the test command (scripts/test.sh runs this
# after the cargo tests; it also runs alone):
#
#   1. chart      helm lint and helm template for each values file of
#                 deploy/helm/delayd, every object validated against the
#                 Kubernetes schemas (kubernetes-validate, strict) and the
#                 ServiceMonitor against the Prometheus Operator's CRD, plus
#                 the chart's promises per shape (scripts/deploy/check_manifests.py);
#   2. alerts     promtool check rules and promtool test rules on
#                 deploy/prometheus/alerts.yml;
#   3. dashboard  a delayd under load (scripts/deploy/load.py: valid,
#                 invalid, unroutable and long-delayed messages) scraped by
#                 a real Prometheus; every query of deploy/grafana/delayd.json
#                 must return data and name only metrics delayd exports;
#   4. page       the status page in headless Chromium against that delayd
#                 (scripts/deploy/status_page.mjs);
#   5. image      the container image built with buildah from a debootstrap
#                 root (scripts/image.sh) and run with podman against the
#                 real RabbitMQ: uid 10001, read-only root filesystem, the
#                 broker-kept store and no volume, `delayd healthcheck` as its
#                 health check; messages on time; `podman stop` exits 0 and a
#                 new container fires what the stopped one held.
#
#   bash scripts/deploy-check.sh [STEP...]     default: every step
#
# Tools, installed once per machine when missing (root needed; about two
# minutes the first time, most of it building helm from the Go module
# proxy): Debian's podman, buildah, chromium and prometheus (promtool); helm
# (go install, Go module proxy); kubernetes-validate and pika (PyPI, in a
# venv); playwright-core (npm); the Prometheus Operator module (Go proxy)
# for the ServiceMonitor CRD; a bookworm root (debootstrap). They live in
# $DEPLOY_CHECK_TOOLS (/var/cache/delayd-tools) and $IMAGE_ROOT.
#
# RabbitMQ must be up on 127.0.0.1:5672 (scripts/rabbitmq.sh). The delayd
# binary is $DEPLOY_CHECK_BIN, default target/debug/delayd (what `cargo test`
# built; built here if missing); the image takes it too, stripped.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
TOOLS=${DEPLOY_CHECK_TOOLS:-/var/cache/delayd-tools}
HELM_VERSION=v3.22.0
KUBERNETES_VALIDATE_VERSION=1.37.0
PLAYWRIGHT_VERSION=1.65.1
PROMETHEUS_OPERATOR_VERSION=v0.85.0
# Kubernetes versions the chart is validated for (native sidecars: 1.29).
KUBE_VERSIONS=1.29.0,1.37.0
STEPS=("$@")
[ "${#STEPS[@]}" -gt 0 ] || STEPS=(chart alerts dashboard page image)
BIN=${DEPLOY_CHECK_BIN:-$REPO/target/debug/delayd}
T0=$SECONDS

say() { echo "deploy-check: $*" >&2; }
die() { say "FAILED: $*"; exit 1; }
want() { local s; for s in "${STEPS[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo

# ------------------------------------------------------------------ tools

apt_install() {
    local missing=() p
    for p in "$@"; do dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
    [ "${#missing[@]}" -eq 0 ] && return 0
    say "installing ${missing[*]} with apt"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 ||
        { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; } ||
        die "cannot install ${missing[*]}"
}

tools() {
    local t0=$SECONDS
    mkdir -p "$TOOLS/bin"
    apt_install prometheus chromium podman buildah debootstrap binutils python3-venv
    # The two slow ones run meanwhile: helm's build (CPU) beside the image's
    # root (network) and the downloads below. (helm built by go install does
    # not know its own version: a stamp file says which it is.)
    local helm_job="" root_job=""
    if [ ! -x "$TOOLS/bin/helm" ] || [ ! -f "$TOOLS/bin/.helm-$HELM_VERSION" ]; then
        say "building helm $HELM_VERSION from the Go module proxy (once per machine, about two minutes)"
        (GOBIN="$TOOLS/bin" CGO_ENABLED=0 \
            go install -trimpath -ldflags='-s -w' "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" &&
            rm -f "$TOOLS"/bin/.helm-* && touch "$TOOLS/bin/.helm-$HELM_VERSION") >"$TOOLS/helm-build.log" 2>&1 &
        helm_job=$!
    fi
    if want image; then
        bash scripts/image.sh --root-only >"$TOOLS/image-root.log" 2>&1 &
        root_job=$!
    fi
    if [ ! -f "$TOOLS/venv/.ready-$KUBERNETES_VALIDATE_VERSION" ]; then
        say "installing kubernetes-validate $KUBERNETES_VALIDATE_VERSION and pika from PyPI"
        rm -rf "$TOOLS/venv"
        python3 -m venv "$TOOLS/venv"
        "$TOOLS/venv/bin/pip" install -q "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" "pika==1.3.2" ||
            die "pip install kubernetes-validate pika"
        touch "$TOOLS/venv/.ready-$KUBERNETES_VALIDATE_VERSION"
    fi
    if [ ! -f "$TOOLS/node/.ready-$PLAYWRIGHT_VERSION" ]; then
        say "installing playwright-core $PLAYWRIGHT_VERSION from npm"
        rm -rf "$TOOLS/node" && mkdir -p "$TOOLS/node"
        (cd "$TOOLS/node" && npm install --silent --no-audit --no-fund "playwright-core@$PLAYWRIGHT_VERSION" >/dev/null) ||
            die "npm install playwright-core"
        touch "$TOOLS/node/.ready-$PLAYWRIGHT_VERSION"
    fi
    local dir
    dir=$(go mod download -json "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION" |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])') ||
        die "go mod download github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION"
    SERVICEMONITOR_CRD="$dir/example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml"
    [ -f "$SERVICEMONITOR_CRD" ] || die "no ServiceMonitor CRD in $dir"
    if [ -n "$helm_job" ]; then
        wait "$helm_job" || { tail -20 "$TOOLS/helm-build.log" >&2; die "go install helm.sh/helm/v3/cmd/helm@$HELM_VERSION"; }
    fi
    if [ -n "$root_job" ]; then
        wait "$root_job" || { tail -20 "$TOOLS/image-root.log" >&2; die "the image's base root (scripts/image.sh --root-only)"; }
    fi
    [ $((SECONDS - t0)) -lt 2 ] || say "tools ready in $((SECONDS - t0)) s"
}

# ------------------------------------------------------------------ 1. chart

check_chart() {
    local t0=$SECONDS chart=deploy/helm/delayd out
    out=$(mktemp -d)
    "$TOOLS/bin/helm" lint --quiet --kube-version 1.31.0 "$chart" >/dev/null || die "helm lint $chart"
    local values name
    for values in "$chart"/values/*.yaml; do
        name=$(basename "$values" .yaml)
        "$TOOLS/bin/helm" template delayd "$chart" --kube-version 1.31.0 -f "$values" >"$out/$name.yaml" ||
            die "helm template -f $values"
    done
    # The defaults, and a Secret made by the chart (secret.values).
    "$TOOLS/bin/helm" template delayd "$chart" >"$out/default.yaml" || die "helm template (defaults)"
    "$TOOLS/bin/helm" template delayd "$chart" --set secret.existingSecret= \
        --set secret.values.admin-token=t --set secret.values.amqp-url=amqp://x >"$out/made-secret.yaml" ||
        die "helm template (secret.values)"
    grep -q "^kind: Secret" "$out/made-secret.yaml" || die "secret.values made no Secret"
    # The sidecar shape refuses a Kubernetes without native sidecars.
    if "$TOOLS/bin/helm" template delayd "$chart" --kube-version 1.28.0 -f "$chart/values/sidecar.yaml" >/dev/null 2>&1; then
        die "the sidecar shape rendered for Kubernetes 1.28"
    fi
    "$TOOLS/venv/bin/python" scripts/deploy/check_manifests.py "$SERVICEMONITOR_CRD" "$KUBE_VERSIONS" "$out"/*.yaml ||
        die "chart manifests"
    rm -rf "$out"
    say "chart: ok ($((SECONDS - t0)) s)"
}

# ------------------------------------------------------------------ 2. alerts

check_alerts() {
    local t0=$SECONDS
    promtool check rules deploy/prometheus/alerts.yml >/dev/null || die "promtool check rules"
    (cd deploy/prometheus && promtool test rules alerts_test.yml >/dev/null) || die "promtool test rules (run it in deploy/prometheus to see why)"
    say "alerts: ok ($((SECONDS - t0)) s)"
}

# ------------------------------------------------------------------ 3 & 4: a delayd under load

WORK=""
DELAYD_PID=""
PROM_PID=""
cleanup() {
    [ -z "$DELAYD_PID" ] || { kill "$DELAYD_PID" 2>/dev/null; wait "$DELAYD_PID" 2>/dev/null || true; }
    [ -z "$PROM_PID" ] || { kill "$PROM_PID" 2>/dev/null; wait "$PROM_PID" 2>/dev/null || true; }
    podman rm -f -t 0 delayd-deploy-check >/dev/null 2>&1 || true
    if [ -n "$WORK" ]; then
        "$TOOLS/venv/bin/python" scripts/deploy/amqp_cleanup.py "$WORK/cleanup.txt" >/dev/null 2>&1 || true
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

wait_http() { # URL SECONDS
    local i
    for i in $(seq 1 $(($2 * 5))); do
        curl -fsS -o /dev/null "$1" 2>/dev/null && return 0
        sleep 0.2
    done
    return 1
}

ensure_bin() {
    [ -x "$BIN" ] && return 0
    say "building $BIN"
    cargo build --quiet --bin delayd || die "cargo build"
}

start_delayd() {
    local suffix=$1
    ADMIN_PORT=$(free_port)
    TOKEN=deploy-check-$RANDOM$RANDOM
    EX=dash.$suffix
    cat >"$WORK/delayd.toml" <<EOF
[wal]
dir = "$WORK/wal"
create_dir = true

[http]
listen = "127.0.0.1:$ADMIN_PORT"
token = "$TOKEN"

[brokers.rabbit]
kind = "amqp"
url = "amqp://guest:guest@127.0.0.1:5672/%2f"

[[routes]]
name = "dash-orders"
from = { broker = "rabbit", queue = "$EX.orders.in", exchange = "$EX.orders.delayed", exchange_type = "topic" }
to   = { broker = "rabbit", exchange = "$EX.orders.out" }
invalid = { queue = "$EX.invalid" }
unroutable = { queue = "$EX.unroutable" }

[[routes]]
name = "dash-later"
from = { broker = "rabbit", queue = "$EX.later.in", exchange = "$EX.later.delayed", exchange_type = "topic" }
to   = { broker = "rabbit", exchange = "$EX.later.out" }
EOF
    printf 'queue %s\n' "$EX.orders.in" "$EX.later.in" "$EX.orders.target" "$EX.invalid" "$EX.unroutable" >"$WORK/cleanup.txt"
    printf 'exchange %s\n' "$EX.orders.delayed" "$EX.later.delayed" "$EX.orders.out" "$EX.later.out" >>"$WORK/cleanup.txt"
    "$TOOLS/venv/bin/python" scripts/deploy/amqp_cleanup.py --declare "$EX.orders.out" "$EX.orders.target" "ok.#" ||
        die "cannot declare the target queue"
    RUST_LOG=warn "$BIN" run --config "$WORK/delayd.toml" >"$WORK/delayd.log" 2>&1 &
    DELAYD_PID=$!
    wait_http "http://127.0.0.1:$ADMIN_PORT/readyz" 30 || { tail -20 "$WORK/delayd.log" >&2; die "delayd did not become ready"; }
}

start_prometheus() {
    PROM_PORT=$(free_port)
    cat >"$WORK/prometheus.yml" <<EOF
global: { scrape_interval: 1s, evaluation_interval: 1s }
scrape_configs:
  - job_name: delayd
    static_configs: [{ targets: ["127.0.0.1:$ADMIN_PORT"] }]
EOF
    prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/prometheus" \
        --web.listen-address="127.0.0.1:$PROM_PORT" --log.level=warn >"$WORK/prometheus.log" 2>&1 &
    PROM_PID=$!
    wait_http "http://127.0.0.1:$PROM_PORT/-/ready" 30 || { tail -20 "$WORK/prometheus.log" >&2; die "prometheus did not start"; }
}

check_live() {
    local t0=$SECONDS
    ensure_bin
    WORK=$(mktemp -d /tmp/delayd-deploy-check.XXXXXX)
    start_delayd "$(date +%s).$$"
    start_prometheus
    # Under load: 1500 messages at 100/s with delays of 1-3 s, 5 invalid, 5
    # unroutable, and 120 due in 10 minutes to a week (they stay pending).
    "$TOOLS/venv/bin/python" scripts/deploy/load.py --exchange "$EX.orders.delayed" \
        --target-queue "$EX.orders.target" --count 1500 --rate 100 --delay-min 1000 --delay-max 3000 \
        --invalid 5 --unroutable 5 --long 120 --long-exchange "$EX.later.delayed" >"$WORK/load.json" ||
        { cat "$WORK/load.json" >&2; die "the load: a message lost, duplicated or early"; }
    say "load: $(cat "$WORK/load.json")"
    # A few scrapes after the last delivery, so every rate has two points.
    sleep 3
    curl -fsS "http://127.0.0.1:$ADMIN_PORT/metrics" >"$WORK/metrics.txt"
    if want dashboard; then
        "$TOOLS/venv/bin/python" scripts/deploy/check_dashboard.py "http://127.0.0.1:$PROM_PORT" \
            deploy/grafana/delayd.json "$WORK/metrics.txt" 1m >"$WORK/dashboard.txt" ||
            { cat "$WORK/dashboard.txt" >&2; die "dashboard"; }
        say "$(tail -1 "$WORK/dashboard.txt")"
    fi
    if want page; then
        PLAYWRIGHT_CORE="$TOOLS/node/node_modules/" node scripts/deploy/status_page.mjs \
            "http://127.0.0.1:$ADMIN_PORT" "$TOKEN" "${SCREENSHOT:-$WORK/status-page.png}" >"$WORK/page.txt" 2>&1 ||
            { cat "$WORK/page.txt" >&2; die "status page"; }
        say "status page: $(grep -c '^ok' "$WORK/page.txt") checks ok"
    fi
    say "dashboard and status page: ok ($((SECONDS - t0)) s)"
    cleanup
    WORK="" DELAYD_PID="" PROM_PID=""
}

# ------------------------------------------------------------------ 5. image

check_image() {
    local t0=$SECONDS name=delayd-deploy-check image=localhost/delayd:deploy-check
    ensure_bin
    IMAGE=$image bash scripts/image.sh "$BIN" || die "scripts/image.sh"
    WORK=$(mktemp -d /tmp/delayd-deploy-check.XXXXXX)
    chmod 755 "$WORK"
    local port ex
    port=$(free_port)
    ex=img.$(date +%s).$$
    local route=img-$(date +%s)-$$
    cat >"$WORK/delayd.toml" <<EOF
[http]
listen = "127.0.0.1:$port"

[engine]
shutdown_grace = "5s"

[brokers.rabbit]
kind = "amqp"
url = "amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=5"

[[routes]]
name = "$route"
from = { broker = "rabbit", queue = "$ex.in", exchange = "$ex.delayed", exchange_type = "topic" }
to   = { broker = "rabbit", exchange = "$ex.out" }
EOF
    chmod 644 "$WORK/delayd.toml"
    printf 'queue %s\n' "$ex.in" "$ex.target" >"$WORK/cleanup.txt"
    printf 'exchange %s\n' "$ex.delayed" "$ex.out" >>"$WORK/cleanup.txt"
    printf 'prefix %s\n' "delayd.state.$route" >>"$WORK/cleanup.txt"
    "$TOOLS/venv/bin/python" scripts/deploy/amqp_cleanup.py --declare "$ex.out" "$ex.target" "#" ||
        die "cannot declare the target queue"
    # This machine's quirks, not the image's: crun refuses a hybrid cgroup
    # v1/v2 host (runc does not); without systemd podman cannot schedule
    # periodic health checks (they run on demand below, `podman healthcheck
    # run`); podman's default ulimits are refused here.
    local quirks=(--ulimit nofile=1024:1024 --ulimit nproc=4096:4096)
    if [ -d /sys/fs/cgroup/unified ]; then
        apt_install runc
        quirks+=(--runtime runc)
    fi
    [ -S /run/systemd/private ] || quirks+=(--health-interval disable)
    run_container() {
        # The broker-kept store, and no volume at all: the image's
        # /var/lib/delayd volume is ignored, the root is read-only, the WAL
        # cache is on the /tmp tmpfs podman gives a read-only container.
        podman run -d --name "$name" --network host --user 10001:10001 --read-only \
            --image-volume ignore "${quirks[@]}" \
            -v "$WORK/delayd.toml:/etc/delayd/delayd.toml:ro" \
            -e DELAYD_STORE__KIND=broker -e DELAYD_WAL__DIR=/tmp/delayd/wal -e DELAYD_WAL__CREATE_DIR=true \
            -e RUST_LOG=warn \
            "$image" >/dev/null 2>"$WORK/podman-run.err" || { cat "$WORK/podman-run.err" >&2; die "podman run"; }
        local i
        for i in $(seq 1 100); do
            podman healthcheck run "$name" >/dev/null 2>&1 && return 0
            sleep 0.3
        done
        podman logs "$name" 2>&1 | tail -20 >&2
        die "the container's health check never passed"
    }
    run_container
    # What the container is.
    local user ro mounts health pid uid
    user=$(podman inspect -f '{{.Config.User}}' "$name")
    ro=$(podman inspect -f '{{.HostConfig.ReadonlyRootfs}}' "$name")
    mounts=$(podman inspect -f '{{range .Mounts}}{{.Type}}:{{.Destination}} {{end}}' "$name")
    health=$(podman inspect -f '{{.Config.Healthcheck.Test}}' "$name")
    pid=$(podman inspect -f '{{.State.Pid}}' "$name")
    uid=$(awk '/^Uid:/ {print $2}' "/proc/$pid/status")
    [ "$user" = "10001:10001" ] && [ "$uid" = 10001 ] || die "the container runs as $user (uid $uid), not 10001"
    [ "$ro" = true ] || die "the root filesystem is not read-only"
    [ "$mounts" = "bind:/etc/delayd/delayd.toml " ] || die "the container has mounts beyond its config: $mounts"
    [ "$health" = "[CMD delayd healthcheck --timeout 2s]" ] || die "the image's health check is not delayd healthcheck: $health"
    podman exec "$name" sh -c 'command -v curl' >/dev/null 2>&1 && die "the image carries curl"
    # The broker-kept store: this one instance comes to own the route.
    local i owner=""
    for i in $(seq 1 100); do
        owner=$(curl -fsS "http://127.0.0.1:$port/metrics" | grep "^delayd_store_owner{route=\"$route\"}" || true)
        [ "$owner" = "delayd_store_owner{route=\"$route\"} 1" ] && break
        sleep 0.2
    done
    [ "$owner" = "delayd_store_owner{route=\"$route\"} 1" ] ||
        die "delayd_store_owner does not show the container owning $route: ${owner:-absent}"
    wait_http "http://127.0.0.1:$port/readyz" 20 || die "the container never became ready"
    # The status page without a token: read-only, no cancel.
    local page
    page=$(curl -fsS "http://127.0.0.1:$port/") || die "GET / of the container"
    grep -q 'id="total-pending"' <<<"$page" || die "the status page shows no counts"
    ! grep -q 'class="cancel"' <<<"$page" || die "a cancel button without a token"

    # Messages on time through the container.
    "$TOOLS/venv/bin/python" scripts/deploy/load.py --url "amqp://guest:guest@127.0.0.1:5672/%2f" \
        --exchange "$ex.delayed" --target-queue "$ex.target" --count 40 --rate 20 \
        --delay-min 1000 --delay-max 2000 --max-late-ms 2000 >"$WORK/on-time.json" ||
        { cat "$WORK/on-time.json" >&2; podman logs "$name" 2>&1 | tail -20 >&2; die "messages through the container"; }
    say "container: $(cat "$WORK/on-time.json")"

    # podman stop while messages are pending: exit 0, and a new container
    # (empty /tmp: the WAL cache is gone with the old one) fires them all.
    "$TOOLS/venv/bin/python" scripts/deploy/load.py --url "amqp://guest:guest@127.0.0.1:5672/%2f" \
        --exchange "$ex.delayed" --target-queue "$ex.target" --count 30 --rate 30 \
        --delay-min 6000 --delay-max 9000 --drain 40 --allow-duplicates >"$WORK/stop.json" &
    local load=$!
    sleep 2.5
    local pending
    pending=$(curl -fsS "http://127.0.0.1:$port/readyz" | python3 -c 'import json,sys; print(json.load(sys.stdin)["pending"])')
    [ "$pending" -gt 0 ] || die "nothing pending in the container before the stop"
    # (podman's own complaints about systemd timers go to a log here.)
    podman stop -t 30 "$name" >/dev/null 2>>"$WORK/podman.err" || { cat "$WORK/podman.err" >&2; die "podman stop"; }
    local code
    code=$(podman inspect -f '{{.State.ExitCode}}' "$name")
    [ "$code" = 0 ] || { podman logs "$name" 2>&1 | tail -20 >&2; die "podman stop: delayd exited with $code"; }
    podman rm "$name" >/dev/null 2>>"$WORK/podman.err"
    run_container
    wait "$load" || { cat "$WORK/stop.json" >&2; podman logs "$name" 2>&1 | tail -30 >&2; die "messages lost across podman stop"; }
    say "container stop: $pending pending at the stop, exit 0; after a new container: $(cat "$WORK/stop.json")"
    podman stop -t 30 "$name" >/dev/null 2>>"$WORK/podman.err"
    code=$(podman inspect -f '{{.State.ExitCode}}' "$name")
    [ "$code" = 0 ] || die "the second container exited with $code"
    podman rm "$name" >/dev/null 2>>"$WORK/podman.err"
    podman rmi "$image" >/dev/null 2>&1 || true
    say "image: ok ($((SECONDS - t0)) s)"
    cleanup
    WORK=""
}

tools
want chart && check_chart
want alerts && check_alerts
if want dashboard || want page; then check_live; fi
want image && check_image
say "all ok in $((SECONDS - T0)) s"

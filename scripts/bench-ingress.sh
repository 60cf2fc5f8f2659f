#!/usr/bin/env bash
# Intake of a classic queue against a stream ingress (a benchmark, not a
# test; issue #37), in one run: how fast delayd takes in a backlog, and its
# CPU per message doing it.
#
#   bash scripts/bench-ingress.sh                  # 200,000 messages, 3 runs
#   COUNT=500000 RUNS=1 INGRESSES="stream" bash scripts/bench-ingress.sh
#
# Each run, for each ingress in turn (classic, then stream):
#   1. delayd (release build, config/examples/bench.toml; for the stream
#      its route reads `delayd.bench.stream` with queue_type = "stream")
#      starts on an empty WAL, declares and binds its ingress, and stops;
#      the other ingress is deleted, so the broker keeps one copy only;
#   2. `delayd bench --publish-only` publishes COUNT messages of 256 bytes
#      with confirms, all due in an hour (nothing fires): the broker's own
#      publish-with-confirms rate into that ingress;
#   3. delayd starts again and takes the backlog in: the time from its start
#      until delayd_scheduled_total reaches COUNT, and its CPU time over it.
# One line per ingress and run: the broker's publish rate, delayd's intake
# rate, intake / publish, delayd's CPU per message.
set -euo pipefail
cd "$(dirname "$0")/.."
count="${COUNT:-200000}"
runs="${RUNS:-3}"
ingresses="${INGRESSES:-classic stream}"

bash scripts/rabbitmq.sh >/dev/null
bash scripts/build-deps.sh
cargo build --release --quiet
delayd="$PWD/target/release/delayd"
work="$(mktemp -d /var/tmp/delayd-bench-ingress.XXXXXX)"
pid=""
stop_delayd() {
    if [ -n "$pid" ]; then
        kill -TERM "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
        pid=""
    fi
}
cleanup() {
    stop_delayd
    for q in delayd.bench delayd.bench.stream; do
        rabbitmqctl -q delete_queue "$q" >/dev/null 2>&1 || true
    done
    if [ -n "${KEEP:-}" ]; then echo "kept $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT

cp config/examples/bench.toml "$work/classic.toml"
sed 's/queue = "delayd.bench",/queue = "delayd.bench.stream", queue_type = "stream",/' \
    config/examples/bench.toml >"$work/stream.toml"
grep -q 'queue_type = "stream"' "$work/stream.toml"

start_delayd() { # ingress
    (cd "$work" && DELAYD_WAL__DIR="$work/wal" RUST_LOG=warn \
        exec "$delayd" run --config "$work/$1.toml" >>"$work/delayd.log" 2>&1) &
    pid=$!
    for _ in $(seq 1 150); do
        curl -sf http://127.0.0.1:9464/readyz >/dev/null && return 0
        sleep 0.2
    done
    echo "delayd did not become ready; its log:" >&2
    tail -20 "$work/delayd.log" >&2
    exit 1
}
scheduled() {
    curl -s http://127.0.0.1:9464/metrics |
        awk '/^delayd_scheduled_total[{ ]/ {s += $NF} END {printf "%d", s}'
}
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
now_ms() { date +%s%3N; }

for run in $(seq 1 "$runs"); do
    for ingress in $ingresses; do
        for q in delayd.bench delayd.bench.stream; do
            rabbitmqctl -q delete_queue "$q" >/dev/null 2>&1 || true
        done
        rm -rf "$work/wal"
        start_delayd "$ingress"
        stop_delayd
        publish=$("$delayd" bench --quiet --publish-only --exchange bench.delayed \
            --queue bench.ingress.unused --count "$count" --rate 1000000 --in-flight 1000 \
            --delay-min 3600000 --delay-max 3600000 |
            sed -n 's/^published [0-9]* (\([0-9]*\) msg\/s).*/\1/p')
        started=$(now_ms)
        (cd "$work" && DELAYD_WAL__DIR="$work/wal" RUST_LOG=warn \
            exec "$delayd" run --config "$work/$ingress.toml" >>"$work/delayd.log" 2>&1) &
        pid=$!
        until [ "$(scheduled 2>/dev/null || echo 0)" -ge "$count" ]; do
            sleep 0.2
            kill -0 "$pid" 2>/dev/null || { echo "delayd exited; its log:" >&2; tail -20 "$work/delayd.log" >&2; exit 1; }
        done
        took=$(($(now_ms) - started))
        ticks=$(cpu_ticks "$pid")
        hz=$(getconf CLK_TCK)
        stop_delayd
        awk -v i="$ingress" -v r="$run" -v n="$count" -v p="$publish" -v t="$took" -v c="$ticks" -v hz="$hz" 'BEGIN {
            rate = n / (t / 1000);
            printf "%-8s run %s: broker publish %6d msg/s | delayd intake %6d msg/s (%3d %% of publish) in %.1f s | delayd CPU %.1f us/msg\n",
                i, r, p, rate, rate / p * 100, t / 1000, c / hz * 1e6 / n
        }'
    done
done

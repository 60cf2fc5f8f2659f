#!/usr/bin/env bash
# RabbitMQ benchmark (not part of the tests): end-to-end lateness through
# delayd and delayd's CPU per message beside the load generator's, the
# figures of docs/benchmarks.md and issue #16.
#
#   bash scripts/bench-amqp.sh                 # rates 2000 5000 7000, 3 runs each
#   RATES="5000" RUNS=5 SECONDS_EACH=10 bash scripts/bench-amqp.sh
#   HOP=1 bash scripts/bench-amqp.sh           # also the broker alone, one hop
#   PENDING=1000000 bash scripts/bench-amqp.sh # then RSS with 1M pending
#
# Starts RabbitMQ (scripts/rabbitmq.sh) if needed, builds delayd in release
# mode and, for every run, starts a fresh delayd (config/examples/bench.toml,
# an empty WAL in a scratch directory), waits for /readyz, runs `delayd
# bench --metrics` (x-delay 1-5 s, 256-byte bodies) and stops delayd with
# SIGTERM. Rates are interleaved (2k, 5k, 7k, 2k, ...) so a noisy minute on
# this shared machine spreads over all of them. One line per run, then the
# median p99 per rate.
set -euo pipefail
cd "$(dirname "$0")/.."
rates="${RATES:-2000 5000 7000}"
runs="${RUNS:-3}"
secs="${SECONDS_EACH:-10}"
pending="${PENDING:-0}"

bash scripts/rabbitmq.sh >/dev/null
cargo build --release --quiet
delayd="$PWD/target/release/delayd"
config="$PWD/config/examples/bench.toml"
work="$(mktemp -d /var/tmp/delayd-bench-amqp.XXXXXX)"
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
    rm -rf "$work"
}
trap cleanup EXIT

start_delayd() {
    rm -rf "$work/wal"
    (cd "$work" && DELAYD_WAL__DIR="$work/wal" RUST_LOG=warn \
        exec "$delayd" run --config "$config" >>"$work/delayd.log" 2>&1) &
    pid=$!
    for _ in $(seq 1 150); do
        curl -sf http://127.0.0.1:9464/readyz >/dev/null && return 0
        sleep 0.2
    done
    echo "delayd did not become ready; its log:" >&2
    tail -20 "$work/delayd.log" >&2
    exit 1
}

# One line from a `delayd bench --json` report.
line() {
    jq -r '"p50 \(.lateness_p50_ms) p99 \(.lateness_p99_ms) max \(.lateness_max_ms) ms | "
        + "lost \(.lost) early \(.early) dup \(.duplicates) | "
        + (if .delayd_cpu_us_per_message then
             "delayd \(.delayd_cpu_us_per_message * 10 | round / 10) us/msg, "
             + "\(.delayd_resident_bytes / 1e6 | round) MB | " else "" end)
        + "bench \(.bench_cpu_us_per_message * 10 | round / 10) us/msg"
        + (if .delayd_cpu_us_per_message then
             " | ratio \(.delayd_cpu_us_per_message / .bench_cpu_us_per_message * 100 | round / 100)"
           else "" end)'
}

results="$work/results"
if [ "${HOP:-0}" = 1 ]; then
    for rate in $rates; do
        report="$("$delayd" bench --quiet --json --exchange bench.hop --queue bench.hop.q \
            --bind-to bench.hop --delay-min 0 --delay-max 0 \
            --rate "$rate" --count $((rate * secs)))"
        printf '%-28s %s\n' "broker alone, one hop, $rate/s" "$(echo "$report" | line)"
    done
fi

for run in $(seq 1 "$runs"); do
    for rate in $rates; do
        start_delayd
        report="$("$delayd" bench --quiet --json --metrics http://127.0.0.1:9464/metrics \
            --exchange bench.delayed --queue bench.q --bind-to bench.out \
            --delay-min 1000 --delay-max 5000 --rate "$rate" --count $((rate * secs)))" || true
        stop_delayd
        printf '%-28s %s\n' "through delayd, $rate/s #$run" "$(echo "$report" | line)"
        echo "$rate $(echo "$report" | jq .lateness_p99_ms)" >>"$results"
    done
done
for rate in $rates; do
    median="$(awk -v r="$rate" '$1 == r {print $2}' "$results" | sort -n |
        awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}')"
    echo "median p99 at $rate/s over $runs runs: $median ms"
done

if [ "$pending" -gt 0 ]; then
    start_delayd
    "$delayd" bench --quiet --exchange bench.delayed --queue bench.q --bind-to bench.out \
        --count "$pending" --rate 12000 --publish-only \
        --delay-min 7200000 --delay-max 7300000 >/dev/null
    until curl -s http://127.0.0.1:9464/metrics |
        awk -v n="$pending" '/^delayd_pending_messages[{ ]/ {s += $NF} END {exit !(s >= n)}'; do
        sleep 1
    done
    printf '%-28s RSS %s MB\n' "$pending pending" \
        "$(awk '/VmRSS/ {printf "%.0f", $2 / 1024}' "/proc/$pid/status")"
    stop_delayd
fi

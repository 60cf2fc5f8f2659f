#!/usr/bin/env bash
# RabbitMQ benchmark (not part of the tests): end-to-end lateness through
# delayd and delayd's CPU per message beside the load generator's, the
# figures of docs/benchmarks.md and issue #16.
#
#   bash scripts/bench-amqp.sh                 # rates 2000 5000 7000, 3 runs each
#   RATES="5000" RUNS=5 SECONDS_EACH=10 bash scripts/bench-amqp.sh
#   HOP=1 bash scripts/bench-amqp.sh           # also the broker alone, one hop
#   PENDING=1000000 bash scripts/bench-amqp.sh # then RSS with 1M pending, and after a restart
#   RELAY=1 bash scripts/bench-amqp.sh         # and the two-hop floor after each run
#   RUN_ENV="TOKIO_WORKER_THREADS=1 DELAYD_WAL__COMMIT_DELAY=10ms" bash scripts/bench-amqp.sh
#                                              # delayd's environment only, not the bench's
#   BIN=/tmp/delayd-other bash scripts/bench-amqp.sh  # another build, for A/B runs
#   BENCH=target/release/delayd BIN=/tmp/delayd-old bash scripts/bench-amqp.sh
#                                              # the load from one build, delayd from another
#
# Starts RabbitMQ (scripts/rabbitmq.sh) if needed, builds delayd in release
# mode and, for every run, starts a fresh delayd (config/examples/bench.toml,
# an empty WAL in a scratch directory), waits for /readyz, runs `delayd
# bench --metrics` (x-delay 1-5 s, 256-byte bodies) and stops delayd with
# SIGTERM. With RELAY=1 each run through delayd is followed by one through
# examples/relay.rs (delayd's two broker hops with its own adapters, no WAL,
# no wheel, no delay): the floor under delayd's lateness on this machine.
# Rates are interleaved (2k, 5k, 7k, 2k, ...) so a noisy minute on
# this shared machine spreads over all of them. One line per run, then the
# median p99 per rate.
set -euo pipefail
cd "$(dirname "$0")/.."
rates="${RATES:-2000 5000 7000}"
runs="${RUNS:-3}"
secs="${SECONDS_EACH:-10}"
pending="${PENDING:-0}"

bash scripts/rabbitmq.sh >/dev/null
bash scripts/build-deps.sh
# With BIN set, BIN is what is measured; the release build is not needed.
if [ -z "${BIN:-}" ] || [ -z "${BENCH:-}" ]; then cargo build --release --quiet; fi
[ "${RELAY:-0}" = 1 ] && cargo build --release --quiet --example relay
# BIN: another build to measure (A/B runs), for delayd and the bench alike.
delayd="${BIN:-$PWD/target/release/delayd}"
# BENCH: the build that drives the load (default: the one measured), so an
# A/B run can keep the load generator the same.
bench="$(realpath "${BENCH:-$delayd}")"
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

start_delayd() { # "keep": on the WAL of the last run, else an empty one
    [ "${1:-}" = keep ] || rm -rf "$work/wal"
    # shellcheck disable=SC2086 # RUN_ENV is a list of NAME=VALUE words
    (cd "$work" && DELAYD_WAL__DIR="$work/wal" RUST_LOG=warn \
        exec env ${RUN_ENV:-} "$delayd" run --config "$config" >>"$work/delayd.log" 2>&1) &
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

relay() { # rate, run
    # delayd's queue is bound to the same exchange: without it gone the
    # broker would store a copy of every message (see examples/relay.rs).
    rabbitmqctl -q delete_queue delayd.bench >/dev/null 2>&1 || true
    RUST_LOG=warn "$PWD/target/release/examples/relay" amqp://guest:guest@127.0.0.1:5672/%2f \
        bench.delayed relay.bench bench.out >>"$work/relay.log" 2>&1 &
    local relay_pid=$!
    # Its queue is declared and its consumer registered: wait for both.
    for _ in $(seq 1 100); do
        rabbitmqctl -q list_queues name consumers 2>/dev/null |
            awk '$1 == "relay.bench" && $2 > 0 {found = 1} END {exit !found}' && break
        sleep 0.2
    done
    local report
    report="$("$bench" bench --quiet --json --exchange bench.delayed --queue bench.q \
        --bind-to bench.out --delay-min 0 --delay-max 0 --rate "$1" --count $(($1 * secs)))" || true
    kill -INT "$relay_pid" 2>/dev/null || true
    wait "$relay_pid" 2>/dev/null || true
    printf '%-28s %s\n' "relay (floor), $1/s #$2" "$(echo "$report" | line)"
    echo "relay $1 $(echo "$report" | jq .lateness_p99_ms)" >>"$results"
}
if [ "${HOP:-0}" = 1 ]; then
    for rate in $rates; do
        report="$("$bench" bench --quiet --json --exchange bench.hop --queue bench.hop.q \
            --bind-to bench.hop --delay-min 0 --delay-max 0 \
            --rate "$rate" --count $((rate * secs)))"
        printf '%-28s %s\n' "broker alone, one hop, $rate/s" "$(echo "$report" | line)"
    done
fi

for run in $(seq 1 "$runs"); do
    for rate in $rates; do
        start_delayd
        report="$("$bench" bench --quiet --json --metrics http://127.0.0.1:9464/metrics \
            --exchange bench.delayed --queue bench.q --bind-to bench.out \
            --delay-min 1000 --delay-max 5000 --rate "$rate" --count $((rate * secs)))" || true
        stop_delayd
        printf '%-28s %s\n' "through delayd, $rate/s #$run" "$(echo "$report" | line)"
        echo "delayd $rate $(echo "$report" | jq .lateness_p99_ms)" >>"$results"
        if [ "${RELAY:-0}" = 1 ]; then
            relay "$rate" "$run"
        fi
    done
done
for what in delayd relay; do
    for rate in $rates; do
        median="$(awk -v w="$what" -v r="$rate" '$1 == w && $2 == r {print $3}' "$results" |
            sort -n | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}')"
        [ -n "$median" ] && echo "$what: median p99 at $rate/s over $runs runs: $median ms"
    done
done

if [ "$pending" -gt 0 ]; then
    start_delayd
    "$bench" bench --quiet --exchange bench.delayed --queue bench.q --bind-to bench.out \
        --count "$pending" --rate 12000 --publish-only \
        --delay-min 7200000 --delay-max 7300000 >/dev/null
    wait_pending() {
        until curl -s http://127.0.0.1:9464/metrics |
            awk -v n="$pending" '/^delayd_pending_messages[{ ]/ {s += $NF} END {exit !(s >= n)}'; do
            sleep 1
        done
    }
    rss() { awk '/VmRSS/ {printf "%.0f", $2 / 1024}' "/proc/$pid/status"; }
    wait_pending
    printf '%-28s RSS %s MB\n' "$pending pending" "$(rss)"
    # A restart rebuilds them all from the WAL: what a memory limit must allow.
    stop_delayd
    start_delayd keep
    wait_pending
    printf '%-28s RSS %s MB\n' "$pending pending, restarted" "$(rss)"
    stop_delayd
fi

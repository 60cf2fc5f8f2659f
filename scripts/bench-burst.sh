#!/usr/bin/env bash
# A burst (a benchmark, not a test; issue #29): COUNT messages all due in
# the same instant, through delayd on RabbitMQ, beside the broker's own
# publish-with-confirms rate measured alone in the same run.
#
#   bash scripts/bench-burst.sh                  # 200,000 messages, 3 runs
#   COUNT=1000000 RATE=25000 RUNS=1 bash scripts/bench-burst.sh
#   COUNT=1000000 DELAY_MS=60000 RUNS=1 bash scripts/bench-burst.sh
#   BIN=target/release-debug/delayd ...   # another build (for a profiler)
#                                  # the intake done before the instant
#
# Each run:
#   1. the floor: `delayd bench --publish-only` publishes COUNT messages
#      with confirms to an exchange of its own with a bound queue (no
#      delayd, no consumer; the queue is deleted after): the rate the
#      broker takes publishes at, alone. Before 2026-11-30 that queue was
#      bound to the burst's target exchange, so it also took a copy of
#      every release (and kept them until the next run's purge);
#   2. delayd (release build, config/examples/bench.toml, an empty WAL)
#      takes COUNT messages in at RATE, every one with the same
#      `x-deliver-at` (`delayd bench --burst`), and releases them when that
#      instant comes: the report's delivery rate is the release rate,
#      `out_of_order` counts messages that overtook an earlier one (equal
#      due times leave in arrival order).
#   3. meanwhile, from 5 s after the burst's first publish on, a second
#      route (its own queue and exchanges, same delayd) takes SIDE_RATE
#      msg/s (default 500) for SIDE_SECONDS (default 20) with x-delay
#      1-2 s: another route's traffic while the burst is taken in and (at
#      the default DELAY_MS) released, with its own lateness.
# One line per run: intake rate, release rate, release / floor, lost,
# early, duplicates, out of order, the last message's lateness, delayd's RSS;
# then the side route's rate, lost, early and lateness.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/bench-lib.sh
count="${COUNT:-200000}"
rate="${RATE:-25000}"
runs="${RUNS:-3}"
# The instant is DELAY_MS after the last publish was planned (at RATE). At
# the default the release overlaps the intake of the burst's tail (delayd
# takes it in slower than RATE); a longer one measures the intake alone,
# then the release alone.
delay="${DELAY_MS:-5000}"

bash scripts/rabbitmq.sh >/dev/null
bash scripts/build-deps.sh
# BIN: another build to measure (e.g. `--profile release-debug` for perf).
if [ -z "${BIN:-}" ]; then cargo build --release --quiet; fi
delayd="$(realpath "${BIN:-target/release/delayd}")"
work="$(mktemp -d /var/tmp/delayd-bench-burst.XXXXXX)"
side_rate="${SIDE_RATE:-500}"
side_seconds="${SIDE_SECONDS:-20}"
config="$work/delayd.toml"
cat config/examples/bench.toml - >"$config" <<'TOML'

# The side route: new messages taken in while the burst is released.
[[routes]]
name = "side"
mode = "delay"
from = { broker = "rabbit", queue = "delayd.side", exchange = "bench.side.delayed", exchange_type = "topic", prefetch = 1000 }
to = { broker = "rabbit", exchange = "bench.side.out" }
TOML
pid=""
cleanup() {
    if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
    if [ -n "${KEEP:-}" ]; then echo "kept $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT

for run in $(seq 1 "$runs"); do
    # 1. The broker alone: publishes with confirms (scripts/bench-lib.sh).
    floor=$(floor_rate "$count" rabbitmqctl)
    # 2. Through delayd, all due at once.
    rm -rf "$work/wal"
    start_delayd "$work" "$config"
    # The side load starts 5 s after the burst's first publish: it overlaps
    # the burst's intake and, at the default DELAY_MS, its release.
    (sleep 5 && exec "$delayd" bench --quiet --json --exchange bench.side.delayed \
        --queue bench.side.q --bind-to bench.side.out --count $((side_rate * side_seconds)) \
        --rate "$side_rate" --delay-min 1000 --delay-max 2000 --drain-timeout 300s \
        >"$work/side.json" 2>>"$work/side.log") &
    side=$!
    report=$("$delayd" bench --quiet --json --burst --exchange bench.delayed --queue bench.q \
        --bind-to bench.out --count "$count" --rate "$rate" --in-flight 1000 \
        --delay-min "$delay" --delay-max "$delay" --drain-timeout 300s \
        --metrics http://127.0.0.1:9464/metrics)
    wait "$side" || echo "the side load failed: $(tail -3 "$work/side.log")" >&2
    # delayd's own lateness for the side route (due to handed to the sink),
    # as the smallest histogram bound that holds 50 % and 99 % of it: what
    # the end-to-end figure adds beyond it is the publish and the consumer.
    side_own=$(curl -s http://127.0.0.1:9464/metrics | awk '
        /^delayd_lateness_seconds_bucket\{/ && /route="side"/ {
            match($0, /le="[^"]*"/); le = substr($0, RSTART + 4, RLENGTH - 5)
            n++; les[n] = le; cnt[n] = $NF }
        END {
            total = cnt[n]; if (total == 0) { print "none"; exit }
            for (i = 1; i <= n; i++) {
                if (p50 == "" && cnt[i] >= 0.5 * total) p50 = les[i]
                if (p99 == "" && cnt[i] >= 0.99 * total) p99 = les[i]
            }
            printf "p50 <= %s s, p99 <= %s s", p50, p99 }')
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    pid=""
    echo "$report" | jq -r --argjson floor "$floor" --arg run "$run" '
        "run \($run): \(.published) in at \(.publish_rate | round) msg/s, released at "
        + "\(.delivery_rate | round) msg/s, the broker alone \($floor | round) msg/s "
        + "(\(.delivery_rate / $floor * 100 | round) %) | lost \(.lost) early \(.early) "
        + "dup \(.duplicates) out of order \(.out_of_order) "
        + "| unconfirmed publishes \(.publish_failures) "
        + "| last \(.lateness_max_ms) ms late"
        + (if .delayd_resident_bytes then " | delayd \(.delayd_resident_bytes / 1e6 | round) MB" else "" end)'
    jq -r --arg run "$run" '"run \($run), side route meanwhile: \(.published) in at \(.publish_rate | round) msg/s "
        + "| lost \(.lost) early \(.early) dup \(.duplicates) "
        + "| lateness p50 \(.lateness_p50_ms) p99 \(.lateness_p99_ms) max \(.lateness_max_ms) ms"' \
        "$work/side.json" 2>/dev/null || echo "run $run: no side report"
    echo "run $run, side route in delayd (due to handed to the sink): $side_own"
done

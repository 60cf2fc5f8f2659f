#!/usr/bin/env bash
# Kafka benchmark (not part of the tests): end-to-end lateness through delayd
# at several rates, beside Apache Kafka alone through one produce+consume hop
# with the same client settings, then again with 1M messages pending.
#
#   bash scripts/bench-kafka.sh            # rates 1000 5000 10000, 15 s each
#   RATES="5000" SECONDS_EACH=30 PENDING=0 bash scripts/bench-kafka.sh
#
# Starts Apache Kafka (scripts/kafka.sh) if needed, builds delayd in release
# mode, runs it with config/examples/bench-kafka.toml in a scratch directory
# and stops it at the end. Prints one line per run; CPU is read from
# /proc/<pid>/stat before and after each run through delayd.
set -euo pipefail
cd "$(dirname "$0")/.."
rates="${RATES:-1000 5000 10000}"
secs="${SECONDS_EACH:-15}"
pending="${PENDING:-1000000}"
bootstrap=127.0.0.1:9092

bash scripts/kafka.sh
bash scripts/build-deps.sh
cargo build --release --quiet
delayd="$PWD/target/release/delayd"
config="$PWD/config/examples/bench-kafka.toml"
work="$(mktemp -d /var/tmp/delayd-bench-kafka.XXXXXX)"
# The bench's own clients, tuned like delayd's (see bench-kafka.toml).
props=(--kafka-property fetch.wait.max.ms=100 --kafka-property linger.ms=1
    --kafka-property socket.nagle.disable=true)
pid=""
cleanup() {
    [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
rss_mb() { awk '/VmRSS/ {printf "%.0f", $2 / 1024}' "/proc/$1/status"; }

bench() { # label, then bench arguments
    local label="$1"
    shift
    local report
    report="$("$delayd" bench --kafka "$bootstrap" --quiet --json "${props[@]}" "$@" 2>/dev/null)" || true
    printf '%-34s %s\n' "$label" "$(echo "$report" | jq -r '"published \(.published) received \(.received) lost \(.lost) early \(.early) dup \(.duplicates) (\(.duplicates_different_id) other id) | p50 \(.lateness_p50_ms) ms p99 \(.lateness_p99_ms) ms max \(.lateness_max_ms) ms"' 2>/dev/null || echo "no report")"
}

through_delayd() { # label, rate
    local before after
    before="$(cpu_ticks "$pid")"
    bench "$1" --topic bench.delay --target-topic bench.out \
        --rate "$2" --count $(($2 * secs)) --delay-min 1000 --delay-max 5000
    after="$(cpu_ticks "$pid")"
    printf '%-34s delayd CPU %s us/msg, RSS %s MB\n' "" \
        "$(( (after - before) * 10000 / ($2 * secs) ))" "$(rss_mb "$pid")"
}

for rate in $rates; do
    bench "broker alone, one hop, $rate/s" --topic bench.hop --target-topic bench.hop \
        --create-topics 4 --rate "$rate" --count $((rate * secs)) --delay-min 0 --delay-max 0
done

(cd "$work" && RUST_LOG=warn exec "$delayd" run --config "$config" >"$work/delayd.log" 2>&1) &
pid=$!
for _ in $(seq 1 100); do
    curl -sf http://127.0.0.1:9464/healthz >/dev/null && break
    sleep 0.2
done
# Topics first (as a deploy would), then a short warm-up run.
bench "warm-up" --topic bench.delay --target-topic bench.out --create-topics 4 \
    --rate 100 --count 200 --delay-min 100 --delay-max 100 >/dev/null
for rate in $rates; do
    through_delayd "through delayd, $rate/s" "$rate"
done

if [ "$pending" -gt 0 ]; then
    start=$SECONDS
    "$delayd" bench --kafka "$bootstrap" --quiet "${props[@]}" --topic bench.delay \
        --target-topic bench.out --count "$pending" --rate 20000 --publish-only \
        --delay-min 7200000 --delay-max 7300000 >/dev/null 2>&1
    until curl -s http://127.0.0.1:9464/metrics |
        grep -q "^delayd_pending_messages{route=\"bench-kafka\"} $pending\$"; do sleep 1; done
    echo "$pending taken in $((SECONDS - start)) s; delayd RSS $(rss_mb "$pid") MB"
    for rate in $rates; do
        through_delayd "$pending pending, $rate/s" "$rate"
    done
fi

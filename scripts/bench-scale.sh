#!/usr/bin/env bash
# Scale up (a benchmark, not a test; issue #29): delayd with N messages
# pending on one node, through RabbitMQ, beside the same run on an empty
# store.
#
#   bash scripts/bench-scale.sh                                  # 0, 1M, 10M
#   COUNTS="0 1000000 10000000 100000000" bash scripts/bench-scale.sh
#
# For each N (0 is the empty-store baseline):
#   1. fill: `delayd bench --fill N` stores N messages (64-byte bodies,
#      delays spread over 1 hour .. 30 days) through the engine's own API,
#      as the AMQP intake would, into an empty WAL (no broker involved);
#   2. delayd (release build, config/examples/bench.toml) starts on that
#      store; 1000 messages are published with a 10 s delay and delayd is
#      killed with SIGKILL at once; once they are overdue it is started
#      again, and the time from that start to its first published message
#      (`delayd_fired_total` > 0) and to /readyz (every route consuming)
#      is taken, polling every 20 ms;
#   3. a load run: `delayd bench` publishes LOAD messages at RATE/s with
#      1-5 s delays and consumes them: intake rate, lateness, lost, early;
#   4. delayd's RSS after the restart and after the load run, and the
#      bytes on disk in the WAL and in the far tier.
# One JSON line per N goes to $work/scale.jsonl and a table to stdout;
# PLOT=file.svg also draws RSS and restart time against N. STORE=dir
# measures an existing filled WAL directory (moved into the work directory
# and back) instead of filling one; COUNTS then names its size.
set -euo pipefail
cd "$(dirname "$0")/.."
counts="${COUNTS:-0 1000000 10000000}"
rate="${RATE:-5000}"
load="${LOAD:-60000}"

bash scripts/rabbitmq.sh >/dev/null
bash scripts/build-deps.sh
cargo build --release --quiet
delayd="$PWD/target/release/delayd"
config="$PWD/config/examples/bench.toml"
work="$(mktemp -d /var/tmp/delayd-bench-scale.XXXXXX)"
metrics=http://127.0.0.1:9464/metrics
pid=""
cleanup() {
    if [ -n "$pid" ]; then kill -KILL "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
    if [ -n "${KEEP:-}" ]; then echo "kept $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT

now_ms() { date +%s%3N; }
start_delayd() {
    (cd "$work" && DELAYD_WAL__DIR="$work/wal" RUST_LOG=warn \
        exec "$delayd" run --config "$config" >>"$work/delayd.log" 2>&1) &
    pid=$!
}
ready() { curl -sf http://127.0.0.1:9464/readyz >/dev/null 2>&1; }
fired() { curl -sf "$metrics" 2>/dev/null | awk '/^delayd_fired_total/ {s += $2} END {print s + 0}'; }
pending() { curl -sf "$metrics" 2>/dev/null | awk '/^delayd_pending_messages/ {s += $2} END {print s + 0}'; }
rss_bytes() { echo $(( $(ps -o rss= -p "$pid") * 1024 )); }

: >"$work/scale.jsonl"
for n in $counts; do
    rm -rf "$work/wal"
    fill='{}'
    if [ -n "${STORE:-}" ]; then
        mv "$STORE" "$work/wal"
        trap 'mv "$work/wal" "$STORE"; cleanup' EXIT
    elif [ "$n" -gt 0 ]; then
        fill=$(DELAYD_WAL__DIR="$work/wal" "$delayd" bench --fill "$n" --config "$config" \
            --route bench --exchange bench.delayed --delay-min 3600000 --delay-max 2592000000 \
            --body-bytes 64 --in-flight 8192 --json ${QUIET:+--quiet})
    fi
    # A first start, then 1000 messages due in 10 s, then SIGKILL.
    start_delayd
    until ready; do sleep 0.05; done
    before=$(pending)
    "$delayd" bench --quiet --publish-only --exchange bench.delayed --queue bench.q \
        --bind-to bench.out --count 1000 --rate 100000 --delay-min 10000 --delay-max 10000 >/dev/null
    # Stored (in the WAL) before the kill.
    until [ "$(pending)" -ge $(( before + 1000 )) ]; do sleep 0.05; done
    [ "$before" -eq "$n" ] || echo "warning: $before pending after the first start, not $n" >&2
    kill -KILL "$pid"
    wait "$pid" 2>/dev/null || true
    pid=""
    sleep 11
    # The restart.
    t0=$(now_ms)
    start_delayd
    first="" up=""
    while [ -z "$first" ] || [ -z "$up" ]; do
        [ -z "$up" ] && ready && up=$(( $(now_ms) - t0 ))
        [ -z "$first" ] && [ "$(fired)" -gt 0 ] && first=$(( $(now_ms) - t0 ))
        [ $(( $(now_ms) - t0 )) -gt 300000 ] && { echo "no restart within 300 s" >&2; exit 1; }
        sleep 0.02
    done
    sleep 2
    rss_restart=$(rss_bytes)
    rabbitmqctl -q purge_queue bench.q >/dev/null
    report=$("$delayd" bench --quiet --json --exchange bench.delayed --queue bench.q \
        --bind-to bench.out --count "$load" --rate "$rate" --delay-min 1000 --delay-max 5000 \
        --metrics "$metrics")
    rss_load=$(rss_bytes)
    disk_wal=$(find "$work/wal" -maxdepth 1 -name 'wal-*.log' -printf '%s\n' | awk '{s += $1} END {print s + 0}')
    disk_far=$(du -sb "$work/wal/far" 2>/dev/null | cut -f1 || echo 0)
    kill -TERM "$pid"
    wait "$pid" 2>/dev/null || true
    pid=""
    jq -cn --argjson n "$n" --argjson fill "$fill" --argjson r "$report" \
        --argjson first "$first" --argjson up "$up" --argjson rss_restart "$rss_restart" \
        --argjson rss_load "$rss_load" --argjson disk_wal "$disk_wal" \
        --argjson disk_far "${disk_far:-0}" '{
            pending: $n, fill_rate: $fill.store_rate, disk_wal: $disk_wal,
            disk_far: $disk_far, restart_first_fire_ms: $first, restart_ready_ms: $up,
            rss_restart: $rss_restart, rss_after_load: $rss_load,
            intake_rate: $r.publish_rate, delivery_rate: $r.delivery_rate,
            lateness_p50_ms: $r.lateness_p50_ms, lateness_p99_ms: $r.lateness_p99_ms,
            lateness_max_ms: $r.lateness_max_ms, lost: $r.lost, early: $r.early,
            duplicates: $r.duplicates}' | tee -a "$work/scale.jsonl" >/dev/null
done

echo "pending | RSS after restart | disk (WAL + far) | restart: first fire / consuming | intake | lateness p50 / p99 / max | lost | early"
jq -r '"\(.pending) | \(.rss_restart / 1048576 | round) MiB | \((.disk_wal + .disk_far) / 1048576 | round) MiB | \(.restart_first_fire_ms) / \(.restart_ready_ms) ms | \(.intake_rate | round) msg/s | \(.lateness_p50_ms) / \(.lateness_p99_ms) / \(.lateness_max_ms) ms | \(.lost) | \(.early)"' \
    "$work/scale.jsonl"
if [ -n "${PLOT:-}" ]; then
    python3 scripts/bench-scale-plot.py "$work/scale.jsonl" "$PLOT"
fi
cp "$work/scale.jsonl" "${OUT:-/var/tmp/delayd-bench-scale.jsonl}"

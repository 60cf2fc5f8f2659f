#!/usr/bin/env bash
# Scale out (a benchmark, not a test; issue #29): one partitioned RabbitMQ
# route (`partitions = PARTS`, broker-kept store) run by 1, 2 and 3
# delayd instances on this machine, beside the relay floor (examples/relay.rs:
# delayd's two broker hops with its own adapters, no WAL, no wheel).
#
#   bash scripts/bench-partitions.sh
#   INSTANCES="1 2 3" PARTS=6 RATE=20000 SECONDS_EACH=10 bash scripts/bench-partitions.sh
#
# For each instance count: fresh WAL directories and state streams, the
# instances started together, then, once every partition has an owner,
# `delayd bench` offers RATE messages/s for SECONDS_EACH s (x-delay 2-4 s,
# 256-byte bodies, spread over 64 routing keys) and consumes them. One
# line per run: the rate taken in, the rate delivered, lateness, lost,
# early, duplicates, and how the partitions were shared.
set -euo pipefail
cd "$(dirname "$0")/.."
instances_list="${INSTANCES:-1 2 3}"
parts="${PARTS:-6}"
rate="${RATE:-20000}"
secs="${SECONDS_EACH:-10}"
count=$((rate * secs))

bash scripts/rabbitmq.sh >/dev/null
bash scripts/build-deps.sh
cargo build --release --quiet
cargo build --release --quiet --example relay
delayd="$PWD/target/release/delayd"
work="$(mktemp -d /var/tmp/delayd-bench-partitions.XXXXXX)"
pids=()
stop_all() {
    local p
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    pids=()
}
cleanup() {
    stop_all
    if [ -n "${KEEP:-}" ]; then echo "kept $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT

config() { # run, instance
    cat <<EOF
[wal]
dir = "$work/wal-$1-$2"
create_dir = true
[http]
listen = "127.0.0.1:$((9470 + $2))"
[store]
kind = "broker"
topic_prefix = "bench-part.$1."
[brokers.rabbit]
kind = "amqp"
url = "amqp://guest:guest@127.0.0.1:5672/%2f"
[[routes]]
name = "scale"
partitions = $parts
from = { broker = "rabbit", queue = "delayd.scale.$1", exchange = "bench.part.$1", prefetch = 1000 }
to = { broker = "rabbit", exchange = "bench.part.out" }
EOF
}

owners() { # instances: partitions consuming, over all of them
    local i total=0 shares=""
    for i in $(seq 1 "$1"); do
        local n
        n=$(curl -s "http://127.0.0.1:$((9470 + i))/readyz" 2>/dev/null |
            jq '[.routes | to_entries[] | select(.value == "consuming")] | length' 2>/dev/null || echo 0)
        total=$((total + n))
        shares="$shares${shares:+/}$n"
    done
    echo "$total $shares"
}

line() {
    jq -r '"in \(.publish_rate | round)/s, delivered \(.delivery_rate | round)/s | lateness p50 \(.lateness_p50_ms) p99 \(.lateness_p99_ms) max \(.lateness_max_ms) ms | lost \(.lost) early \(.early) dup \(.duplicates) (other id \(.duplicates_different_id))"'
}

for k in $instances_list; do
    run="k$k.$(date +%s)"
    for i in $(seq 1 "$k"); do
        config "$run" "$i" >"$work/delayd-$k-$i.toml"
        (cd "$work" && RUST_LOG=warn exec "$delayd" run --config "$work/delayd-$k-$i.toml" \
            >>"$work/delayd-$k-$i.log" 2>&1) &
        pids+=($!)
    done
    settled=""
    for _ in $(seq 1 1200); do
        read -r total shares < <(owners "$k")
        if [ "$total" -eq "$parts" ]; then settled="$shares"; break; fi
        sleep 0.1
    done
    [ -n "$settled" ] || { echo "$k instance(s): the partitions never all had an owner" >&2; exit 1; }
    report=$("$delayd" bench --quiet --json --exchange "bench.part.$run" --queue bench.part.q --routing-keys 64 \
        --bind-to bench.part.out --rate "$rate" --count "$count" --delay-min 2000 --delay-max 4000 \
        --drain-timeout 60s)
    printf '%s instance(s), partitions %s: %s\n' "$k" "$settled" "$(echo "$report" | line)"
    stop_all
    rabbitmqctl -q purge_queue bench.part.q >/dev/null 2>&1 || true
done

# The floor: the same offered load through two hops and no delay.
RUST_LOG=warn "$PWD/target/release/examples/relay" amqp://guest:guest@127.0.0.1:5672/%2f \
    bench.part.relay relay.part bench.part.out >>"$work/relay.log" 2>&1 &
relay=$!
for _ in $(seq 1 100); do
    rabbitmqctl -q list_queues name consumers 2>/dev/null |
        awk '$1 == "relay.part" && $2 > 0 {found = 1} END {exit !found}' && break
    sleep 0.2
done
report=$("$delayd" bench --quiet --json --exchange bench.part.relay --queue bench.part.q \
    --bind-to bench.part.out --rate "$rate" --count "$count" --delay-min 0 --delay-max 0)
kill -INT "$relay" 2>/dev/null || true
wait "$relay" 2>/dev/null || true
printf 'relay (floor): %s\n' "$(echo "$report" | line)"

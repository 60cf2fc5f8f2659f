#!/usr/bin/env bash
# Scale out (a benchmark, not a test; issues #29, #38): one partitioned
# RabbitMQ route (`partitions = PARTS`, broker-kept store) run by 1, 2 and 3
# delayd instances on this machine, beside the relay floor (examples/relay.rs:
# delayd's two broker hops with its own adapters, no WAL, no wheel). With
# BROKER=kafka: one Kafka route whose source topic has PARTS partitions,
# the instances sharing its consumer group (each with its own WAL), beside
# Kafka alone through one produce+consume hop.
#
#   bash scripts/bench-partitions.sh
#   BROKER=kafka CPU=10 RATE=4000 bash scripts/bench-partitions.sh
#
# STORES="broker local" (RabbitMQ) runs the instance counts once per store:
# `broker` is the broker-kept store with `partitions = PARTS`, `local` the
# same route on each instance's own WAL (no [store], no partitions; the
# instances share the ingress queue). So one run compares the broker-kept
# store with the local one and the relay floor:
#   INSTANCES=1 PARTS=1 STORES="broker local" RATE=10000 bash scripts/bench-partitions.sh
#
# RESULTS=file.jsonl appends one JSON line per instance count, for
# scripts/bench-partitions-plot.py (docs/scale-out.svg).
#   INSTANCES="1 2 3" PARTS=6 RATE=20000 SECONDS_EACH=10 bash scripts/bench-partitions.sh
#   CPU=15 RATE=6000 bash scripts/bench-partitions.sh   # each instance capped
#
# CPU=P caps each delayd instance at P % of one core with a cgroup of its
# own (cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us`; root), so that one
# instance is CPU-bound well below what the broker and the load generator
# can take on this machine's two cores: scale-out then shows as delivered
# throughput growing with the instance count.
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
cpu_cap="${CPU:-}"
results="${RESULTS:-}"
broker="${BROKER:-rabbitmq}"
stores="${STORES:-broker}"
[ "$broker" = rabbitmq ] || stores=local
bootstrap=127.0.0.1:9092
kafka_props=(--kafka-property fetch.wait.max.ms=100 --kafka-property linger.ms=1
    --kafka-property socket.nagle.disable=true)

case "$broker" in
rabbitmq) bash scripts/rabbitmq.sh >/dev/null ;;
kafka) bash scripts/kafka.sh >/dev/null ;;
*) echo "BROKER=$broker: rabbitmq or kafka" >&2; exit 2 ;;
esac
bash scripts/build-deps.sh
cargo build --release --quiet
cargo build --release --quiet --example relay
# BIN: another build to run as the instances (A/B runs); BENCH: the build
# that drives the load (default: the one measured).
delayd="$(realpath "${BIN:-$PWD/target/release/delayd}")"
bench="$(realpath "${BENCH:-$delayd}")"
work="$(mktemp -d /var/tmp/delayd-bench-partitions.XXXXXX)"
pids=()
stop_all() {
    local p
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    pids=()
}
cgroups=()
# A cgroup capped at $cpu_cap % of a core; its cgroup.procs path in $procs.
make_cgroup() { # name
    local dir
    if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
        dir="/sys/fs/cgroup/$1"
        grep -qw cpu /sys/fs/cgroup/cgroup.subtree_control ||
            echo +cpu >/sys/fs/cgroup/cgroup.subtree_control
        mkdir -p "$dir"
        echo "$((cpu_cap * 1000)) 100000" >"$dir/cpu.max"
    else
        dir="/sys/fs/cgroup/cpu/$1"
        mkdir -p "$dir"
        echo 100000 >"$dir/cpu.cfs_period_us"
        echo "$((cpu_cap * 1000))" >"$dir/cpu.cfs_quota_us"
    fi
    cgroups+=("$dir")
    procs="$dir/cgroup.procs"
}
cleanup() {
    stop_all
    local dir
    for dir in "${cgroups[@]}"; do rmdir "$dir" 2>/dev/null || true; done
    if [ -n "${KEEP:-}" ]; then echo "kept $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT

config() { # run, instance, store
    cat <<EOF
[wal]
dir = "$work/wal-$1-$2"
create_dir = true
[http]
listen = "127.0.0.1:$((9470 + $2))"
EOF
    if [ "$broker" = kafka ]; then
        cat <<EOF
[brokers.kafka]
kind = "kafka"
bootstrap = "$bootstrap"
properties = { "socket.nagle.disable" = "true" }
consumer_properties = { "fetch.wait.max.ms" = "100" }
producer_properties = { "linger.ms" = "1" }
[[routes]]
name = "scale"
from = { broker = "kafka", topics = ["bench.part.$1"], group = "delayd-part-$1" }
to = { broker = "kafka", topic = "bench.part.out.$1" }
EOF
    else
        # The broker-kept store and its partitions; the local store has neither.
        [ "$3" = local ] || cat <<EOF
[store]
kind = "broker"
topic_prefix = "bench-part.$1."
EOF
        cat <<EOF
[brokers.rabbit]
kind = "amqp"
url = "amqp://guest:guest@127.0.0.1:5672/%2f"
[[routes]]
name = "scale"
$([ "$3" = local ] || echo "partitions = $parts")
from = { broker = "rabbit", queue = "delayd.scale.$1", exchange = "bench.part.$1", prefetch = 1000 }
to = { broker = "rabbit", exchange = "bench.part.out" }
EOF
    fi
}

owners() { # instances: partitions owned, over all of them, and the shares
    local i total=0 shares="" n
    for i in $(seq 1 "$1"); do
        if [ "$broker" = kafka ]; then
            # The last assignment each instance logged.
            n=$(grep "Kafka partitions assigned" "$work/delayd-$1-$i.log" 2>/dev/null | tail -n 1 |
                grep -o '("bench.part' | wc -l || true)
        else
            n=$(curl -s "http://127.0.0.1:$((9470 + i))/readyz" 2>/dev/null |
                jq '[.routes | to_entries[] | select(.value == "consuming")] | length' 2>/dev/null || echo 0)
        fi
        [ "$n" -gt 0 ] || n=0
        total=$((total + n))
        shares="$shares${shares:+/}$n"
    done
    echo "$total $shares"
}

# Runs `delayd bench` for run $1 with the rest as arguments.
bench() {
    local run="$1"
    shift
    if [ "$broker" = kafka ]; then
        "$bench" bench --kafka "$bootstrap" "${kafka_props[@]}" --quiet --json \
            --topic "bench.part.$run" --target-topic "bench.part.out.$run" "$@"
    else
        "$bench" bench --quiet --json --exchange "bench.part.$run" --queue bench.part.q \
            --routing-keys 64 --bind-to bench.part.out "$@"
    fi
}

line() {
    jq -r '"in \(.publish_rate | round)/s, delivered \(.delivery_rate | round)/s | lateness p50 \(.lateness_p50_ms) p99 \(.lateness_p99_ms) max \(.lateness_max_ms) ms | lost \(.lost) early \(.early) dup \(.duplicates) (other id \(.duplicates_different_id))"'
}

for store in $stores; do
want=$parts
[ "$store" = broker ] || want=1
for k in $instances_list; do
    run="k$k.$(date +%s)"
    if [ "$broker" = kafka ]; then
        # The topics before the group forms, as a deploy would have them
        # (and one record, due in an hour, outside the measurement).
        bench "$run" --create-topics "$parts" --publish-only --count 1 --rate 1 \
            --delay-min 3600000 --delay-max 3600000 >/dev/null
    fi
    for i in $(seq 1 "$k"); do
        config "$run" "$i" "$store" >"$work/delayd-$k-$i.toml"
        procs=""
        [ -z "$cpu_cap" ] || make_cgroup "delayd-bench-$k-$i"
        (cd "$work" && { [ -z "$procs" ] || echo "$BASHPID" >"$procs"; } &&
            RUST_LOG=warn,delayd_adapters::kafka::source=info exec "$delayd" run \
                --config "$work/delayd-$k-$i.toml" \
            >>"$work/delayd-$k-$i.log" 2>&1) &
        pids+=($!)
    done
    settled=""
    for _ in $(seq 1 1200); do
        read -r total shares < <(owners "$k")
        # Every partition owned, and by every instance (a group that is
        # still forming gives all of them to its first member for a while).
        if [ "$store" = local ] && [ "$broker" = rabbitmq ] && [ "$total" -ge "$k" ]; then
            settled="$shares"
            break
        fi
        if [ "$total" -eq "$want" ] && { [ "$k" -gt "$want" ] || [[ "/$shares/" != */0/* ]]; }; then
            settled="$shares"
            break
        fi
        sleep 0.1
    done
    [ -n "$settled" ] || { echo "$k instance(s): the partitions never all had an owner" >&2; exit 1; }
    report=$(bench "$run" --rate "$rate" --count "$count" --delay-min 2000 --delay-max 4000 \
        --drain-timeout 60s)
    printf '%s instance(s)%s, %s store, partitions %s: %s\n' "$k" "${cpu_cap:+ at $cpu_cap % CPU each}" \
        "$store" "$settled" "$(echo "$report" | line)"
    if [ -n "$results" ]; then
        echo "$report" | jq -c --arg broker "$broker" --arg store "$store" --arg cpu "${cpu_cap:-100}" --argjson k "$k" \
            '{broker: $broker, store: $store, cpu: ($cpu | tonumber), instances: $k,
              delivered: (.delivery_rate | round), intake: (.publish_rate | round),
              p99_ms: .lateness_p99_ms, lost, early, duplicates}' >>"$results"
    fi
    stop_all
    [ "$broker" = kafka ] || rabbitmqctl -q purge_queue bench.part.q >/dev/null 2>&1 || true
done
done

if [ "$broker" = kafka ]; then
    # The floor: Kafka alone through one produce+consume hop, same load.
    run="hop.$(date +%s)"
    "$bench" bench --kafka "$bootstrap" "${kafka_props[@]}" --quiet --json --topic "bench.part.$run" \
        --target-topic "bench.part.$run" --create-topics "$parts" --publish-only --count 1 --rate 1 \
        --delay-min 3600000 --delay-max 3600000 >/dev/null
    report=$("$bench" bench --kafka "$bootstrap" "${kafka_props[@]}" --quiet --json \
        --topic "bench.part.$run" --target-topic "bench.part.$run" --rate "$rate" --count "$count" \
        --delay-min 0 --delay-max 0)
    printf 'Kafka alone, one hop (floor): %s\n' "$(echo "$report" | line)"
    exit 0
fi

# The floor: the same offered load through two hops and no delay.
RUST_LOG=warn "$PWD/target/release/examples/relay" amqp://guest:guest@127.0.0.1:5672/%2f \
    bench.part.relay relay.part bench.part.out >>"$work/relay.log" 2>&1 &
relay=$!
for _ in $(seq 1 100); do
    rabbitmqctl -q list_queues name consumers 2>/dev/null |
        awk '$1 == "relay.part" && $2 > 0 {found = 1} END {exit !found}' && break
    sleep 0.2
done
report=$("$bench" bench --quiet --json --exchange bench.part.relay --queue bench.part.q \
    --bind-to bench.part.out --rate "$rate" --count "$count" --delay-min 0 --delay-max 0)
kill -INT "$relay" 2>/dev/null || true
wait "$relay" 2>/dev/null || true
printf 'relay (floor): %s\n' "$(echo "$report" | line)"

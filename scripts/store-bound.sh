#!/usr/bin/env bash
# How big the broker-kept store's state grows (`store.kind = "broker"`):
# delayd (release build) on a Kafka route (the state topic) or, with
# BROKER=rabbitmq, on a RabbitMQ route (the state streams), while
# `delayd bench` sends COUNT messages at RATE per second with 1-5 s delays,
# then WAIT seconds of idle (for Kafka's log cleaner). Every 10 s it prints
# delayd's pending count and the state's bytes on disk, and at the end the
# peak and final figures. A benchmark-like command, not part of the test
# command.
#
#   bash scripts/store-bound.sh                       # 1,000,000 at 3000/s
#   COUNT=200000 RATE=2000 WAIT=300 bash scripts/store-bound.sh
#   BROKER=rabbitmq WAIT=30 bash scripts/store-bound.sh
#   STORE_KIND=local ...                              # the same load, local store (baseline)
set -euo pipefail
cd "$(dirname "$0")/.."

count="${COUNT:-1000000}"
rate="${RATE:-3000}"
wait_after="${WAIT:-720}"
http=127.0.0.1:9466
kafka_data="${KAFKA_HOME:-/var/tmp/delayd-kafka}/data"
broker="${BROKER:-kafka}"
# RabbitMQ keeps each stream in a directory named after the queue.
stream_data="${RABBITMQ_STREAM_DIR:-/var/lib/rabbitmq/mnesia/rabbit@$(hostname -s)/stream}"

if [ "$broker" = rabbitmq ]; then
    bash scripts/rabbitmq.sh >/dev/null
else
    bash scripts/kafka.sh >/dev/null
fi
bash scripts/build-deps.sh
cargo build --release --quiet
delayd="$PWD/target/release/delayd"
tag="$(date +%s)"
work="$(mktemp -d /var/tmp/delayd-store-bound.XXXXXX)"
route="bound"
state_topic="bound.state.$tag.$route"
pid=""
cleanup() {
    [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    cp "$work/delayd.log" /var/tmp/delayd-store-bound.log 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

cat >"$work/delayd.toml" <<EOF
[wal]
dir = "$work/wal"
create_dir = true

[store]
kind = "${STORE_KIND:-broker}"
topic_prefix = "bound.state.$tag."

[http]
listen = "$http"

[log]
level = "warn"

[brokers.kafka]
kind = "kafka"
bootstrap = "127.0.0.1:9092"

[brokers.rabbit]
kind = "amqp"
url = "amqp://guest:guest@127.0.0.1:5672/%2f"

EOF
if [ "$broker" = rabbitmq ]; then
    cat >>"$work/delayd.toml" <<EOF
[[routes]]
name = "$route"
from = { broker = "rabbit", queue = "bound.$tag.in", exchange = "bound.$tag.delayed", prefetch = 1000 }
to = { broker = "rabbit", exchange = "bound.$tag.out" }
EOF
else
    cat >>"$work/delayd.toml" <<EOF
[[routes]]
name = "$route"
from = { broker = "kafka", topics = ["bound.$tag.delay"], group = "delayd-bound-$tag" }
to = { broker = "kafka", topic = "bound.$tag.out" }
EOF
fi

# The topics exist before delayd starts (the state topic is sized on them).
if [ "$broker" = kafka ]; then
    "$delayd" bench --quiet --kafka 127.0.0.1:9092 --topic "bound.$tag.delay" \
        --target-topic "bound.$tag.out" --create-topics 4 --count 1 --publish-only >/dev/null 2>&1
fi
"$delayd" run --config "$work/delayd.toml" >"$work/delayd.log" 2>&1 &
pid=$!
for _ in $(seq 1 100); do
    curl -sf "http://$http/readyz" >/dev/null && break
    sleep 0.2
done

pending() {
    curl -s --max-time 5 "http://$http/readyz" |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["pending"])' 2>/dev/null || echo 0
}
# Record bytes only: Kafka preallocates each segment's index files (10 MiB).
# RabbitMQ: the segment files of the route's pointer and generation streams.
state_bytes() {
    if [ "$broker" = rabbitmq ]; then
        { cat "$stream_data"/*"${state_topic//./_}"*/*.segment 2>/dev/null || true; } | wc -c
    else
        { cat "$kafka_data/$state_topic"-*/*.log 2>/dev/null || true; } | wc -c
    fi
}

if [ "$broker" = rabbitmq ]; then
    target=(--exchange "bound.$tag.delayed" --queue "bound.$tag.q" --bind-to "bound.$tag.out")
else
    target=(--kafka 127.0.0.1:9092 --topic "bound.$tag.delay" --target-topic "bound.$tag.out"
        --create-topics 4)
fi
"$delayd" bench --quiet --json "${target[@]}" --count "$count" --rate "$rate" \
    --delay-min 1000 --delay-max 5000 --body-bytes 256 --drain-timeout 300s \
    >"$work/bench.json" 2>"$work/bench.log" &
bench=$!
t0=$SECONDS
peak_pending=0
peak_bytes=0
sample() {
    local p b
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "store-bound: delayd exited; its log: /var/tmp/delayd-store-bound.log" >&2
        exit 1
    fi
    p="$(pending)"
    b="$(state_bytes)"
    ((p > peak_pending)) && peak_pending=$p
    ((b > peak_bytes)) && peak_bytes=$b
    echo "store-bound: $1 t=$((SECONDS - t0))s pending $p  state $((b / 1024)) KiB"
}
while kill -0 "$bench" 2>/dev/null; do
    sample load
    sleep 10
done
wait "$bench" || true
python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("store-bound: bench", {k: r[k] for k in ("published","received","lost","early","duplicates","lateness_p99_ms")})' "$work/bench.json"
idle_until=$((SECONDS + wait_after))
while ((SECONDS < idle_until)); do
    sample idle
    sleep 10
done
final=$(state_bytes)
echo "store-bound: $count messages at $rate/s: peak pending $peak_pending," \
    "peak state $((peak_bytes / 1024)) KiB ($((peak_bytes / (peak_pending > 0 ? peak_pending : 1))) B per peak pending message)," \
    "after ${wait_after}s idle $((final / 1024)) KiB"

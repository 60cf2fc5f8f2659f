#!/usr/bin/env bash
# The fault campaign: delayd under steady load while faults are injected,
# every message accounted for by `delayd bench` (delivered once, duplicated,
# lost or early). One scenario per fault, each on a fresh WAL:
#
#   kill9       kill -9 of delayd at a random moment, then a restart
#   sigterm     SIGTERM with publishes in flight, then a restart
#   broker      RabbitMQ restarted (rabbitmqctl stop_app / start_app)
#   connections rabbitmqctl close_all_connections
#   disk        the WAL's disk (a small tmpfs) filled up, then freed
#   kafka       Apache Kafka restarted under a Kafka route
#   handoff     the pod replaced: SIGTERM with engine.handoff = true, the WAL
#               directory deleted, a fresh instance started (a sidecar with no
#               volume in a rolling update)
#   store       the instance and its disk lost: kill -9 with the WAL directory
#               deleted, a fresh instance started, on a Kafka route with
#               store.kind = "broker" (pending messages come back from the
#               state topic)
#   store-amqp  the same on a RabbitMQ route (the pending messages come back
#               from the route's state streams once the new instance takes
#               the route's lock)
#   store-amqp-broker  (long run only) RabbitMQ restarted under that route (its
#               owner loses the route's lock, is elected again once the
#               broker is back, and restores from the state streams)
#
#   bash scripts/faults.sh            # the long run: 100 kill -9 cycles, 10 of the rest
#   bash scripts/faults.sh --short    # a few cycles of each (part of scripts/test.sh)
#   SCENARIOS="kill9 disk" CYCLES=20 RATE=300 bash scripts/faults.sh
#   KEEP=1 LOG=info ...    # keep delayd's logs (at that level) and the reports
#   TWINS=1 ...            # every message a twin (default: one in ten)
#   INGRESS=stream ...     # RabbitMQ routes read a stream (from.queue_type =
#                          # "stream"), except handoff, which needs a queue
#                          # (the config check refuses a stream)
#   INGRESS=quorum ...     # RabbitMQ routes read a quorum queue
#   KAFKA_CONSUMER='"group.protocol" = "consumer"' ...
#                          # the Kafka routes' consumer_properties (TOML
#                          # key = value pairs), e.g. KIP-848's protocol
#   KAFKA_PROPERTIES='"reconnect.backoff.max.ms" = "1000"' ...
#                          # the Kafka broker's properties (producer and
#                          # consumer alike), the same way
#
# Pass: 0 lost and 0 early in every scenario, 0 duplicates under another
# x-delayd-id than the first copy's in every scenario (a copy can only be
# the same stored message sent again), duplicates at most 0.1 % of the messages received (1 % in the short run, whose few thousand messages
# make a handful of duplicates a large share). Lost counts only publishes the broker confirmed; early is
# judged against the bench's own clock at publish, before delayd saw the
# message, so it can only under-count lateness, never invent an early one.
# Twins (one message in ten published twice as the same bytes) must each
# arrive, under an id of their own or (kept while the first one's ack was
# in doubt) under the first one's: a lost twin copy fails (issue #37).
# Needs root for the tmpfs of the disk scenario. It restarts the local
# brokers, so run it alone, not beside the integration tests.
set -euo pipefail
cd "$(dirname "$0")/.."

short=false
[ "${1:-}" = "--short" ] && short=true
# Duplicates allowed, in per mille of the messages received: a fault cuts
# off the confirms of the publishes in flight, a handful each time, which
# over the few thousand messages of a short run can pass 0.1 %.
all_scenarios="kill9 sigterm broker connections disk kafka handoff store store-amqp"
if $short; then
    default_cycles=2 kill_cycles=3 rate="${RATE:-200}" dup_permille=10
else
    default_cycles=10 kill_cycles=100 rate="${RATE:-500}" dup_permille=1
    # Long run only: once in about seven runs its delayd stopped consuming
    # after two quick broker restarts (see docs/fault-campaign.md).
    all_scenarios+=" store-amqp-broker"
fi
cycles="${CYCLES:-}"
scenarios="${SCENARIOS:-$all_scenarios}"
http=127.0.0.1:9465

bash scripts/rabbitmq.sh >/dev/null
bash scripts/kafka.sh >/dev/null
if $short; then
    # The test command has just built the debug binary: no release build.
    cargo build --quiet
    delayd="$PWD/target/debug/delayd"
else
    cargo build --release --quiet
    delayd="$PWD/target/release/delayd"
fi
work="$(mktemp -d /var/tmp/delayd-faults.XXXXXX)"
# Kafka topics of the store scenario are this run's own: its state topic
# must not hold an earlier run's pending messages.
run_tag="$(date +%s)"
pid=""
failed=0
passed=0

cleanup() {
    stop_delayd 9
    if mountpoint -q "$work/disk" 2>/dev/null; then umount "$work/disk"; fi
    if [ -n "${KEEP:-}" ]; then log "logs kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

log() { echo "faults: $*" >&2; }

# --- delayd ------------------------------------------------------------

is_kafka() { [ "$1" = kafka ] || [ "$1" = store ]; }
kafka_topic() { # scenario, role
    if [ "$1" = store ]; then echo "faults.store.$run_tag.$2"; else echo "faults.kafka.$2"; fi
}
kafka_group() {
    if [ "$1" = store ]; then echo "delayd-faults-store-$run_tag"; else echo "delayd-faults"; fi
}

# A stream ingress (INGRESS=stream) where the scenario allows one.
uses_stream() {
    [ "${INGRESS:-classic}" = stream ] && case "$1" in handoff | store) false ;; *) true ;; esac
}
ingress_queue() { # scenario: the route's queue keys
    if uses_stream "$1"; then
        echo "queue = \"delayd.faults.$1.stream\", queue_type = \"stream\""
    elif [ "${INGRESS:-classic}" = quorum ]; then
        echo "queue = \"delayd.faults.$1.quorum\", queue_type = \"quorum\""
    else
        echo "queue = \"delayd.faults.$1\""
    fi
}

write_config() { # scenario, wal dir
    local s="$1" wal="$2"
    local segment="" engine=""
    [ "$s" = disk ] && segment=$'segment_bytes = 262144\n'
    # WAL_COMMIT_DELAY="0ms": compare duplicates per kill with and without
    # the group commit's wait (docs/fault-campaign.md).
    [ -n "${WAL_COMMIT_DELAY:-}" ] && segment+="commit_delay = \"$WAL_COMMIT_DELAY\""$'\n'
    [ -n "${WAL_DONE_WAIT:-}" ] && segment+="done_wait = \"$WAL_DONE_WAIT\""$'\n'
    [ "$s" = handoff ] && engine=$'[engine]\nhandoff = true\n'
    local store=""
    case "$s" in store | store-amqp*)
        store=$'[store]\nkind = "broker"\ntopic_prefix = "faults.state.'"$run_tag"$'."\n' ;;
    esac
    # Frequent checkpoints, so kills land in the middle of some.
    [ "$s" = store-amqp ] && store+=$'checkpoint_records = 2000\n'
    {
        cat <<EOF
[wal]
dir = "$wal"
create_dir = true
$segment
[http]
listen = "$http"

$engine
$store
[log]
level = "${LOG:-warn}"

[brokers.rabbit]
kind = "amqp"
url = "amqp://guest:guest@127.0.0.1:5672/%2f"

[brokers.kafka]
kind = "kafka"
bootstrap = "127.0.0.1:9092"
${KAFKA_PROPERTIES:+properties = { $KAFKA_PROPERTIES \}}
${KAFKA_CONSUMER:+consumer_properties = { $KAFKA_CONSUMER \}}

EOF
        if is_kafka "$s"; then
            cat <<EOF
[[routes]]
name = "faults-$s"
from = { broker = "kafka", topics = ["$(kafka_topic "$s" delay)"], group = "$(kafka_group "$s")" }
to = { broker = "kafka", topic = "$(kafka_topic "$s" out)" }
EOF
        else
            cat <<EOF
[[routes]]
name = "faults-$s"
from = { broker = "rabbit", $(ingress_queue "$s"), exchange = "faults.$s.delayed", prefetch = 200 }
to = { broker = "rabbit", exchange = "faults.$s.out" }
EOF
        fi
    } >"$work/$s.toml"
}

start_delayd() { # scenario
    (cd "$work" && exec "$delayd" run --config "$work/$1.toml" >>"$work/$1.log" 2>&1) &
    pid=$!
    for _ in $(seq 1 150); do
        curl -sf "http://$http/healthz" >/dev/null && return 0
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.2
    done
    log "delayd did not start; its log:"
    tail -n 30 "$work/$1.log" >&2
    return 1
}

stop_delayd() { # signal
    [ -z "$pid" ] && return 0
    kill "-$1" "$pid" 2>/dev/null || true
    for _ in $(seq 1 300); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
    { wait "$pid"; } 2>/dev/null || true
    pid=""
}

# --- faults --------------------------------------------------------------

pause() { sleep "$(awk -v s="$RANDOM" 'BEGIN { printf "%.2f", 0.5 + (s % 250) / 100 }')"; }

inject_kill9() { pause; stop_delayd 9; start_delayd "$1"; }
inject_sigterm() { pause; stop_delayd TERM; start_delayd "$1"; }
# (set -e does not hold inside `if run_scenario`: failures are returned.)
inject_broker() {
    pause
    rabbitmqctl -q stop_app >/dev/null
    sleep 3
    rabbitmqctl -q start_app >/dev/null
    rabbitmqctl -q await_startup >/dev/null 2>&1 || true
}
inject_connections() {
    pause
    rabbitmqctl -q close_all_connections "fault campaign" >/dev/null 2>&1 || true
}
inject_disk() {
    pause
    # Fill what is left of the tmpfs, hold it full, then free it.
    dd if=/dev/zero of="$work/disk/filler" bs=64k >/dev/null 2>&1 || true
    sleep 3
    rm -f "$work/disk/filler"
}
inject_kafka() { pause; bash scripts/kafka.sh restart >/dev/null; }
inject_store() {
    pause
    stop_delayd 9
    # The instance and its disk are gone; the state topic has what it held.
    rm -rf "$work/store-wal"
    start_delayd "$1"
}
inject_store-amqp() {
    pause
    stop_delayd 9
    rm -rf "$work/store-amqp-wal"
    start_delayd "$1"
}
inject_store-amqp-broker() { inject_broker; }
inject_handoff() {
    pause
    stop_delayd TERM
    # The pod and its disk are gone; what it held is back in the queue.
    rm -rf "$work/handoff-wal"
    start_delayd "$1"
}

# --- one scenario ----------------------------------------------------------

run_scenario() { # scenario, cycles
    local s="$1" n="$2" wal="$work/$1-wal"
    if [ "$s" = disk ]; then
        mkdir -p "$work/disk"
        mount -t tmpfs -o size=8m tmpfs "$work/disk"
        wal="$work/disk/wal"
    fi
    write_config "$s" "$wal"
    # A stream keeps what it held: an earlier run's messages are not this one's.
    uses_stream "$s" && { rabbitmqctl -q delete_queue "delayd.faults.$s.stream" >/dev/null 2>&1 || true; }
    if is_kafka "$s"; then
        # The topics exist before delayd subscribes (as in a deploy).
        "$delayd" bench --quiet --kafka 127.0.0.1:9092 --topic "$(kafka_topic "$s" delay)" \
            --target-topic "$(kafka_topic "$s" out)" --create-topics 4 --count 1 --publish-only \
            >/dev/null 2>&1
    fi
    start_delayd "$s" || return 1
    # The load starts once the route consumes (its exchange exists): a
    # broker-kept store's route first takes its lock and restores.
    for _ in $(seq 1 150); do
        curl -sf "http://$http/readyz" >/dev/null && break
        sleep 0.2
    done
    # About 4 s per cycle, plus load on either side, so a handful of
    # duplicates per fault (publishes whose confirm a fault cut off) stays
    # well under 0.1 % of the messages.
    local count=$((rate * (6 * n + 12)))
    # One message in ten is published twice as the same bytes (twins, a
    # producer sending one event twice on purpose): both must arrive.
    local bench=(--quiet --json --count "$count" --rate "$rate" --delay-min 1000
        --delay-max 5000 --drain-timeout 90s --body-bytes 512 --twins "${TWINS:-10}")
    if is_kafka "$s"; then
        bench+=(--kafka 127.0.0.1:9092 --topic "$(kafka_topic "$s" delay)"
            --target-topic "$(kafka_topic "$s" out)" --create-topics 4)
    else
        bench+=(--exchange "faults.$s.delayed" --queue "faults.$s.q"
            --bind-to "faults.$s.out")
    fi
    local start=$SECONDS
    # Bounded: a hung bench fails its scenario instead of the whole run.
    timeout "$((count / rate + 300))" \
        "$delayd" bench "${bench[@]}" >"$work/$s.json" 2>"$work/$s.bench.log" &
    local bench_pid=$!
    sleep 3
    for i in $(seq 1 "$n"); do
        if ! "inject_$s" "$s"; then
            log "$s: cycle $i failed"
            kill "$bench_pid" 2>/dev/null || true
            stop_delayd 9
            if [ "$s" = disk ]; then umount "$work/disk"; fi
            return 1
        fi
        log "$s: cycle $i/$n done"
    done
    wait "$bench_pid" || true
    local took=$((SECONDS - start))
    if [ ! -s "$work/$s.json" ]; then
        log "$s: the bench reported nothing; its log:"
        tail -n 20 "$work/$s.bench.log" >&2
    fi
    stop_delayd TERM
    if [ "${s#store-amqp}" != "$s" ]; then
        # This run's state streams (their prefix carries the run's tag).
        rabbitmqctl -q list_queues name --no-table-headers 2>/dev/null |
            grep "^faults\.state\.$run_tag\." | while read -r q; do
            rabbitmqctl -q delete_queue "$q" >/dev/null 2>&1 || true
        done
    fi
    if [ "$s" = disk ]; then
        umount "$work/disk"
        # The scenario proves something only if the disk really filled.
        if ! grep -q "DISK FULL\|WAL write failed" "$work/$s.log"; then
            log "disk: delayd never saw a full disk"
            return 1
        fi
    fi
    # One identity per message in every scenario: a copy under another
    # x-delayd-id means a message stored twice, and fails.
    # A broker restart also leaves every ack in flight at the reset in
    # doubt (each such delivery comes back and is stored again under its
    # own id: a same-id duplicate, as the contract allows), and it stops
    # the publishes meanwhile, so the short run's few confirmed messages
    # see 1-2 % (1.08 % in one CI run, 1.6 % with TWINS=1): 2.5 % there.
    local permille="$dup_permille"
    if $short && [ "$s" = broker ]; then permille=25; fi
    python3 scripts/faults/report.py "$s" "$n" "$took" "$permille" "$work/$s.json"
}

for s in $scenarios; do
    n="${cycles:-$default_cycles}"
    [ "$s" = kill9 ] && n="${cycles:-$kill_cycles}"
    if run_scenario "$s" "$n"; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
        log "$s failed; delayd's log: $work/$s.log (kept)"
        cp "$work/$s.log" "/var/tmp/delayd-faults-$s.log" 2>/dev/null || true
    fi
done
echo "faults: $passed scenarios ok, $failed failed"
[ "$failed" -eq 0 ]

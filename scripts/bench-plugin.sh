#!/usr/bin/env bash
# delayd against the delayed-message plugin, on the broker the plugin last
# loads on (a benchmark, not a test; issue #38):
#
#   bash scripts/bench-plugin.sh                  # 200,000 messages, 1 run
#   COUNT=1000000 RUNS=2 bash scripts/bench-plugin.sh
#
# RabbitMQ 3.10 is Debian 12's rabbitmq-server on the host
# (`RABBITMQ=3.10 bash scripts/rabbitmq.sh`, which refuses while the 4.3
# node holds port 5672: stop it first with `bash scripts/rabbitmq.sh stop`).
# The plugin is rabbitmq-delayed-message-exchange v3.10.2, built here with
# erlc from its source in scripts/rabbitmq/delayed-message-exchange-3.10.2
# (MPL 2.0, copied unchanged from the tag) against the broker's own headers,
# and enabled on that broker.
#
# Each run, with one driver (`delayd bench`) for every system:
#   1. the broker's publish-with-confirms rate alone (no consumer);
#   2. the broker alone, one hop: publish and consume through a topic
#      exchange, no delay;
#   3. delayd (release build, config/examples/bench.toml, an empty WAL):
#      COUNT messages at RATE, all due at one instant (`x-deliver-at`);
#   4. the plugin: the same burst to an `x-delayed-message` exchange
#      (`x-delay` counted to the same instant, since the plugin reads no
#      other header).
# A burst's release rate is the bench's delivery rate: the first arrival to
# the last. Its "last" is how late the last message arrived.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/bench-lib.sh
count="${COUNT:-200000}"
rate="${RATE:-25000}"
runs="${RUNS:-1}"
# The instant is DELAY_MS after the last publish was planned (at RATE). It
# must leave both systems time to take every message in, or the release
# overlaps the intake: by default 1 ms per 2.5 messages, since the plugin
# took 200k in at 4.2k msg/s and 1M at 2.6-2.8k msg/s on this machine.
delay="${DELAY_MS:-$((count * 2 / 5))}"
plugin=rabbitmq_delayed_message_exchange
plugin_version=3.10.2
exchange=bench.plugin.delayed

# The plugin keeps its messages in a Mnesia table on disk. After a 1M run
# its files held 870 MB (the table empty by then), and the broker's next
# start gave up waiting for the table to load (`timeout_waiting_for_tables`).
# A bench's leftovers are worth nothing: drop them while the broker is down.
if ! (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; then
    for f in /var/lib/rabbitmq/mnesia/rabbit@*/rabbit_delayed_message*.DC[DL]; do
        [ -e "$f" ] || continue
        echo "== removing the plugin's table file of an earlier run: $f ($(du -h "$f" | cut -f1))" >&2
        rm -f "$f"
    done
fi
RABBITMQ=3.10 bash scripts/rabbitmq.sh >/dev/null
rabbitmqctl=/usr/sbin/rabbitmqctl
lib=$(ls -d /usr/lib/rabbitmq/lib/rabbitmq_server-3.10.*/plugins | tail -1)

# The plugin, built once per broker install.
dest="$lib/$plugin-$plugin_version"
if [ ! -f "$dest/ebin/$plugin.app" ]; then
    echo "== building $plugin $plugin_version with erlc into $dest" >&2
    src=scripts/rabbitmq/delayed-message-exchange-$plugin_version/src
    mkdir -p "$dest/ebin"
    ERL_LIBS="$lib" erlc -o "$dest/ebin" "$src"/*.erl
    modules=$(cd "$src" && ls -- *.erl | sed 's/\.erl$//' | paste -sd, -)
    # What erlang.mk would write from the plugin's Makefile.
    cat >"$dest/ebin/$plugin.app" <<APP
{application, '$plugin', [
    {description, "RabbitMQ Delayed Message Exchange"},
    {vsn, "$plugin_version"},
    {modules, [$modules]},
    {registered, []},
    {applications, [kernel, stdlib, rabbit_common, rabbit]},
    {mod, {rabbit_delayed_message_app, []}},
    {env, []},
    {broker_version_requirements, ["3.10.0"]}
]}.
APP
fi
/usr/sbin/rabbitmq-plugins -q enable "$plugin" >/dev/null
# The plugin's exchange; the bench binds its queue to it.
$rabbitmqctl -q eval "rabbit_exchange:declare(rabbit_misc:r(<<\"/\">>, exchange, <<\"$exchange\">>),
    'x-delayed-message', true, false, false, [{<<\"x-delayed-type\">>, longstr, <<\"topic\">>}],
    <<\"delayd-bench\">>)." >/dev/null

bash scripts/build-deps.sh
cargo build --release --quiet
delayd="$PWD/target/release/delayd"
config="$PWD/config/examples/bench.toml"
work="$(mktemp -d /var/tmp/delayd-bench-plugin.XXXXXX)"
pid=""
cleanup() {
    if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
    if [ -n "${KEEP:-}" ]; then echo "kept $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT

burst_line() { # name, report json
    echo "$2" | jq -r --arg name "$1" '"\($name): \(.published) in at \(.publish_rate | round) msg/s, "
        + "released at \(.delivery_rate | round) msg/s, the last \(.lateness_max_ms / 1000) s after the instant "
        + "| lost \(.lost) early \(.early) dup \(.duplicates) out of order \(.out_of_order) "
        + "| unconfirmed publishes \(.publish_failures)"'
}

echo "RabbitMQ $($rabbitmqctl -q version 2>/dev/null || echo 3.10), plugin $plugin_version, $count messages of 256 B, offered at $rate msg/s"
for run in $(seq 1 "$runs"); do
    # 1. The broker alone: publishes with confirms (scripts/bench-lib.sh).
    floor=$(floor_rate "$count" "$rabbitmqctl")
    # 2. The broker alone, one hop.
    hop=$("$delayd" bench --quiet --json --exchange bench.hop --queue burst.hop.q \
        --bind-to bench.hop --count "$count" --rate 1000000 --in-flight 1000 \
        --delay-min 0 --delay-max 0 --drain-timeout 300s | jq .delivery_rate)
    printf 'run %s: the broker alone: publish with confirms %.0f msg/s; publish and consume, one hop %.0f msg/s\n' \
        "$run" "$floor" "$hop"
    # 3. delayd.
    rm -rf "$work/wal"
    start_delayd "$work" "$config"
    report=$("$delayd" bench --quiet --json --burst --exchange bench.delayed --queue bench.q \
        --bind-to bench.out --count "$count" --rate "$rate" --in-flight 1000 \
        --delay-min "$delay" --delay-max "$delay" --drain-timeout 600s)
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    pid=""
    burst_line "run $run: delayd" "$report"
    # 4. The plugin: its exchange routes to the bench's queue when due.
    report=$("$delayd" bench --quiet --json --burst --delaying-exchange --exchange "$exchange" \
        --queue burst.plugin.q --bind-to "$exchange" --count "$count" --rate "$rate" --in-flight 1000 \
        --delay-min "$delay" --delay-max "$delay" --drain-timeout 600s)
    burst_line "run $run: plugin" "$report"
done

# Sourced by the bench scripts (not run on its own).

# start_delayd WORK CONFIG: start "$delayd" on CONFIG in the background,
# its WAL in WORK/wal and its log appended to WORK/delayd.log, and wait up
# to 30 s for /readyz. Sets `pid`. Fails with the end of the log if delayd
# exits or does not become ready, rather than letting the bench run against
# nothing.
start_delayd() {
    local work=$1 config=$2
    (cd "$work" && DELAYD_WAL__DIR="$work/wal" RUST_LOG=warn \
        exec "$delayd" run --config "$config" >>"$work/delayd.log" 2>&1) &
    pid=$!
    for _ in $(seq 1 150); do
        curl -sf http://127.0.0.1:9464/readyz >/dev/null && return 0
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.2
    done
    echo "delayd did not become ready; the end of its log ($work/delayd.log):" >&2
    tail -n 20 "$work/delayd.log" >&2
    return 1
}

# floor_rate COUNT RABBITMQCTL: the broker's publish-with-confirms rate
# alone (msg/s): COUNT messages into a queue of its own exchange, no
# consumer, no delayd. The exchange is not a target of any route: a queue
# bound to a target would take a copy of every release. The queue is
# deleted after, and with it any binding an older run left.
floor_rate() {
    local count=$1 rabbitmqctl=$2 rate
    rate=$("$delayd" bench --quiet --publish-only --exchange bench.floor --queue burst.floor.q \
        --bind-to bench.floor --count "$count" --rate 1000000 --in-flight 1000 \
        --delay-min 0 --delay-max 0 | sed -n 's/^published [0-9]* (\([0-9]*\) msg\/s).*/\1/p')
    "$rabbitmqctl" -q delete_queue burst.floor.q >/dev/null
    echo "$rate"
}

#!/usr/bin/env bash
# Make sure Apache Kafka listens on 127.0.0.1:9092: a single node in KRaft
# mode (broker and controller in one process, controller on 9093), with TLS
# listeners beside it: SSL on 9094 (client certificate required) and
# SASL_SSL on 9095 (SCRAM-SHA-512 user "delayd", or OAUTHBEARER),
# certificates and password from scripts/tls.sh. A broker this script
# started with another configuration (an older scripts/kafka/server.properties)
# is restarted with the current one (about 10 s).
#
#   scripts/kafka.sh          start it unless it already answers (the default)
#   scripts/kafka.sh stop     stop the one this script started (SIGTERM, then wait)
#   scripts/kafka.sh restart  stop, then start on the same data
#
# The broker's jars come from Maven's registry, pinned by
# scripts/kafka/pom.xml, and are copied once per machine into
# $KAFKA_HOME/libs (`mvn dependency:copy-dependencies`, about 20 s the first
# time). Its storage is formatted once under $KAFKA_HOME/data and kept
# across restarts; its log is $KAFKA_HOME/logs/server.log.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
home="${KAFKA_HOME:-/var/tmp/delayd-kafka}"
libs="$home/libs"
data="$home/data"
logs="$home/logs"
pidfile="$home/kafka.pid"
tls_dir="$(bash "$here/tls.sh" dir)"
version="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$here/kafka/pom.xml")"

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/${1:-9092}") 2>/dev/null; }
tls_listeners_open() { port_open 9094 && port_open 9095; }

# Does the broker answer a Metadata request (v4, all topics) with a
# response that lists at least one broker? A listening port is not enough.
answers_metadata() {
    timeout 10 bash -c '
        exec 3<>/dev/tcp/127.0.0.1/9092 || exit 1
        # size 21 | api_key 3 | version 4 | correlation 1 | client "health"
        # | topics null | allow_auto_topic_creation false
        printf "\x00\x00\x00\x15\x00\x03\x00\x04\x00\x00\x00\x01\x00\x06health\xff\xff\xff\xff\x00" >&3
        # size(4) correlation(4) throttle(4) brokers count(4): one or more brokers.
        reply="$(head -c 16 <&3 | od -An -tx1 | tr -d " \n")"
        [ "${#reply}" -eq 32 ] && [ "${reply:24:8}" != "00000000" ]
    ' 2>/dev/null
}

running_pid() {
    [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null && cat "$pidfile"
}

stop() {
    local pid
    if pid="$(running_pid)"; then
        echo "kafka: stopping pid $pid"
        kill "$pid"
        for _ in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        if kill -0 "$pid" 2>/dev/null; then
            echo "kafka: still running after 60 s; SIGKILL"
            kill -9 "$pid" || true
        fi
    fi
    rm -f "$pidfile"
}

fetch_jars() {
    if [ -f "$libs/.complete-$version" ]; then return; fi
    echo "kafka: fetching Apache Kafka $version's jars with Maven into $libs (once)"
    local start=$SECONDS
    rm -rf "$libs"
    mkdir -p "$libs"
    mvn -q -B -f "$here/kafka/pom.xml" dependency:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory="$libs"
    touch "$libs/.complete-$version"
    echo "kafka: jars fetched in $((SECONDS - start)) s"
}

# The JVM's arguments: a 1 GiB heap cap leaves room for RabbitMQ, delayd
# and the tests on a 2-core, 24 GiB machine.
jvm=(java -Xms256m -Xmx1g -XX:+UseG1GC -XX:MaxGCPauseMillis=20
    -Djava.awt.headless=true
    -Dkafka.logs.dir="$logs"
    -Dlog4j2.configurationFile="$here/kafka/log4j2.properties"
    -cp "$libs/*")

# The SCRAM-SHA-512 user "delayd" of the SASL_SSL listener, with the
# password of scripts/tls.sh: set through the PLAINTEXT listener (kept in the
# cluster's metadata), again only when that password changes.
scram_user() {
    local password marker
    password="$(cat "$tls_dir/kafka-password")"
    marker="$home/scram-user.$(printf %s "$password" | sha256sum | cut -c1-16)"
    [ -f "$marker" ] && return 0
    echo "kafka: setting the SCRAM-SHA-512 password of user delayd"
    "${jvm[@]}" "$here/kafka/ScramUser.java" 127.0.0.1:9092 delayd "$password" \
        >"$logs/scram.log" 2>&1 || { cat "$logs/scram.log" >&2; exit 1; }
    rm -f "$home"/scram-user.*
    touch "$marker"
}

# The broker's configuration as this script writes it (server.properties
# with the certificates' directory and the storage).
properties() {
    sed "s|@TLS_DIR@|$tls_dir|g" "$here/kafka/server.properties"
    echo "log.dirs=$data"
}

start() {
    bash "$here/tls.sh"
    if port_open; then
        local current=yes
        if running_pid >/dev/null && ! properties | cmp -s - "$home/server.properties"; then
            current=no
        fi
        if answers_metadata && tls_listeners_open && [ "$current" = yes ]; then
            echo "kafka: already listening on 127.0.0.1:9092 (SSL 9094, SASL_SSL 9095)"
            scram_user
            return
        fi
        if answers_metadata && running_pid >/dev/null; then
            echo "kafka: running with an older configuration than scripts/kafka/server.properties: restarting it"
            stop
        elif answers_metadata; then
            echo "kafka: a broker this script did not start listens on 127.0.0.1:9092 without the SSL (9094) and SASL_SSL (9095) listeners the tests use" >&2
            exit 1
        else
            echo "kafka: something on 127.0.0.1:9092 does not answer Kafka requests" >&2
            exit 1
        fi
    fi
    fetch_jars
    mkdir -p "$data" "$logs"
    local props="$home/server.properties"
    properties >"$props"
    if [ ! -f "$data/meta.properties" ]; then
        echo "kafka: formatting storage in $data"
        local id
        id="$("${jvm[@]}" kafka.tools.StorageTool random-uuid)"
        "${jvm[@]}" kafka.tools.StorageTool format --standalone \
            --cluster-id "$id" --config "$props" >"$logs/format.log" 2>&1 \
            || { cat "$logs/format.log" >&2; exit 1; }
    fi
    echo "kafka: starting Apache Kafka $version (log: $logs/server.log)"
    local start=$SECONDS
    # 9>&-: the broker must not hold the lock of this script.
    nohup "${jvm[@]}" kafka.Kafka "$props" >>"$logs/stdout.log" 2>&1 9>&- &
    echo $! >"$pidfile"
    local pid
    pid="$(cat "$pidfile")"
    for _ in $(seq 1 240); do
        if port_open && answers_metadata && tls_listeners_open; then
            echo "kafka: up in $((SECONDS - start)) s"
            scram_user
            return
        fi
        if ! kill -0 "$pid" 2>/dev/null; then break; fi
        sleep 0.5
    done
    echo "kafka: did not start within 120 s; its output:" >&2
    tail -n 30 "$logs/stdout.log" >&2 || true
    tail -n 50 "$logs/server.log" >&2 || true
    exit 1
}

# One start or stop at a time on this machine.
mkdir -p "$home"
exec 9>"$home.lock"
flock -w 600 9

case "${1:-start}" in
start) start ;;
stop) stop ;;
restart) stop; start ;;
*) echo "usage: $0 [start|stop|restart]" >&2; exit 2 ;;
esac

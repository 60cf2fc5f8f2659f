#!/usr/bin/env bash
# Make sure a Kafka-protocol broker listens on 127.0.0.1:9092.
# Uses tansu (an Apache-Kafka-compatible broker from cargo's registry),
# installing it once with cargo (about 15 minutes) and reusing the binary.
# Its data lives in SQLite under ${TANSU_DATA:-/var/tmp/delayd-tansu}, so it
# survives a broker restart.
set -euo pipefail

port_open() { (exec 3<>/dev/tcp/127.0.0.1/9092) 2>/dev/null; }

# Does the broker answer a Metadata request (v0, all topics)? A listening
# port is not enough: tansu 0.6 can lose its storage task to a panic and
# then reset every connection while still listening.
answers_metadata() {
    timeout 10 bash -c '
        exec 3<>/dev/tcp/127.0.0.1/9092 || exit 1
        # size 20 | api_key 3 | version 0 | correlation 1 | client "health" | topics []
        printf "\x00\x00\x00\x14\x00\x03\x00\x00\x00\x00\x00\x01\x00\x06health\x00\x00\x00\x00" >&3
        [ "$(head -c 8 <&3 | wc -c)" -eq 8 ]
    ' 2>/dev/null
}

if port_open; then
    if answers_metadata; then
        echo "kafka: already listening on 127.0.0.1:9092"
        exit 0
    fi
    if pgrep -f "tansu broker" >/dev/null; then
        echo "kafka: tansu listens but does not answer; restarting it"
        pkill -f "tansu broker" || true
        for _ in $(seq 1 50); do port_open || break; sleep 0.2; done
    else
        echo "kafka: something on 127.0.0.1:9092 does not answer Kafka requests" >&2
        exit 1
    fi
fi

export PATH="$HOME/.cargo/bin:$PATH"
if ! command -v tansu >/dev/null 2>&1; then
    echo "kafka: installing tansu with cargo (once; about 15 minutes)"
    cargo install --locked tansu --features libsql,dynostore
fi

data="${TANSU_DATA:-/var/tmp/delayd-tansu}"
mkdir -p "$data"
log="$data/tansu.log"
echo "kafka: starting tansu (sqlite in $data, log in $log)"
# tansu resolves a sqlite:// path against its working directory.
(cd "$data" && exec nohup tansu broker \
    --listener-url tcp://127.0.0.1:9092 \
    --advertised-listener-url tcp://127.0.0.1:9092 \
    --storage-engine "sqlite://tansu.db" \
    >>"$log" 2>&1) &
pid=$!
for _ in $(seq 1 60); do
    if port_open && answers_metadata; then
        echo "kafka: up"
        exit 0
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
done
echo "kafka: tansu did not start within 60 s; its log:" >&2
tail -n 50 "$log" >&2
exit 1

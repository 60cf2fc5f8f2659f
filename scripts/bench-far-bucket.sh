#!/usr/bin/env bash
# One far bucket that holds a lot (a benchmark, not a test; issue #36):
# COUNT messages of SIZE bytes, all with one `x-deliver-at`, through delayd
# on RabbitMQ with `engine.horizon = HORIZON`, so that they are spilled into
# one far bucket, then loaded and fired together. Reports what
# `delayd bench --burst` reports (lost, early, duplicates, order, rates)
# and delayd's peak RSS (VmHWM) over the whole run: taking them in,
# spilling, loading and firing. The issue's bound is 512 MiB for 400,000
# messages of 4 KiB.
#
#   bash scripts/bench-far-bucket.sh                     # 400,000 x 4 KiB
#   COUNT=100000 SIZE=1024 RATE=5000 bash scripts/bench-far-bucket.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/bench-lib.sh
count="${COUNT:-400000}"
size="${SIZE:-4096}"
rate="${RATE:-4000}"
horizon="${HORIZON:-10s}"
# After the last publish: far beyond the horizon, so every message spills.
after_ms="${AFTER_MS:-30000}"

bash scripts/rabbitmq.sh >/dev/null
bash scripts/build-deps.sh
[ -n "${NO_BUILD:-}" ] || cargo build --release --quiet
delayd="$PWD/target/release/delayd"
work="$(mktemp -d /var/tmp/delayd-bench-far.XXXXXX)"
config="$work/delayd.toml"
cat config/examples/bench.toml - >"$config" <<TOML

[engine]
horizon = "$horizon"
TOML
pid=""
cleanup() {
    if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
    if [ -n "${KEEP:-}" ]; then echo "kept $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT

start_delayd "$work" "$config"
# The far tier's peak, sampled while the bench runs.
(
    peak_far=0
    while kill -0 "$pid" 2>/dev/null; do
        far=$(curl -sf http://127.0.0.1:9464/metrics | awk '$1 == "delayd_far_messages" {print $2}')
        far=${far%.*}
        [ -n "$far" ] && [ "$far" -gt "$peak_far" ] && peak_far=$far && echo "$peak_far" >"$work/peak_far"
        sleep 1
    done
) &
sampler=$!
report=$("$delayd" bench --quiet --json --burst --exchange bench.delayed --queue bench.q \
    --bind-to bench.out --count "$count" --rate "$rate" --in-flight 1000 --body-bytes "$size" \
    --delay-min "$after_ms" --delay-max "$after_ms" --drain-timeout 600s \
    --metrics http://127.0.0.1:9464/metrics)
hwm_kb=$(awk '/^VmHWM:/ {print $2}' "/proc/$pid/status")
far_errors=$(curl -sf http://127.0.0.1:9464/metrics | awk '$1 == "delayd_far_errors_total" {s += $2} END {print s + 0}')
corrupt=$(curl -sf http://127.0.0.1:9464/metrics | awk '$1 == "delayd_far_corrupt_frames_total" {s += $2} END {print s + 0}')
kill -TERM "$pid" 2>/dev/null || true
wait "$pid" 2>/dev/null || true
pid=""
kill "$sampler" 2>/dev/null || true
peak_far=$(cat "$work/peak_far" 2>/dev/null || echo 0)
echo "$report" | jq -r --arg hwm "$hwm_kb" --arg far "$peak_far" --arg size "$size" \
    --arg errors "$far_errors" --arg corrupt "$corrupt" '
    "\(.published) messages of \($size) bytes in at \(.publish_rate | round) msg/s, "
    + "at most \($far) in the far tier at once, released at \(.delivery_rate | round) msg/s "
    + "| lost \(.lost) early \(.early) dup \(.duplicates) out of order \(.out_of_order) "
    + "| last \(.lateness_max_ms) ms late | far errors \($errors), corrupt frames \($corrupt) "
    + "| delayd peak RSS \($hwm | tonumber / 1024 | round) MiB"'

#!/usr/bin/env bash
# The far tier on a disk that fills up and frees again (a fault run, not a
# test; issue #36): `wal.dir` on a 96 MiB tmpfs, `engine.horizon = "2s"`,
# COUNT messages of 4 KiB with x-delay 40-70 s, and a filler file taking
# FILL_MIB of the tmpfs, removed after 15 s. Reports what `delayd bench`
# reports (lost, early, duplicates), the far tier's error counter when the
# space came back (+10 s) and at the end (it steps once or twice each time
# delayd's own messages fill the disk again, and must not climb), and its
# corrupt frames (must be 0). Needs root (mount).
#
#   bash scripts/bench-far-full-disk.sh
#   COUNT=10000 FILL_MIB=80 bash scripts/bench-far-full-disk.sh
#   SEGMENT_BYTES=8388608 bash scripts/bench-far-full-disk.sh   # wal.segment_bytes
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/bench-lib.sh
count="${COUNT:-30000}"
rate="${RATE:-2000}"
fill_mib="${FILL_MIB:-72}"

bash scripts/rabbitmq.sh >/dev/null
bash scripts/build-deps.sh
[ -n "${NO_BUILD:-}" ] || cargo build --release --quiet
delayd="$PWD/target/release/delayd"
work="$(mktemp -d /var/tmp/delayd-bench-full.XXXXXX)"
mkdir "$work/wal"
mount -t tmpfs -o size=96m tmpfs "$work/wal"
config="$work/delayd.toml"
cat config/examples/bench.toml - >"$config" <<TOML

[engine]
horizon = "2s"
TOML
pid=""
cleanup() {
    if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
    umount "$work/wal" 2>/dev/null || true
    if [ -n "${KEEP:-}" ]; then echo "kept $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT
metric() {
    curl -sf http://127.0.0.1:9464/metrics | awk -v m="$1" '$1 == m {s += $2} END {print s + 0}'
}

[ -n "${SEGMENT_BYTES:-}" ] && export DELAYD_WAL__SEGMENT_BYTES="$SEGMENT_BYTES"
start_delayd "$work" "$config"
dd if=/dev/zero of="$work/wal/filler" bs=1M count="$fill_mib" status=none
(
    sleep 15
    errors_full=$(metric delayd_far_errors_total)
    rm -f "$work/wal/filler"
    sleep 10
    echo "$errors_full $(metric delayd_far_errors_total)" >"$work/errors_back"
) &
filler=$!
report=$("$delayd" bench --quiet --json --exchange bench.delayed --queue bench.q \
    --bind-to bench.out --count "$count" --rate "$rate" --in-flight 1000 --body-bytes 4096 \
    --delay-min 40000 --delay-max 70000 --drain-timeout 300s \
    --metrics http://127.0.0.1:9464/metrics)
wait "$filler"
read -r errors_full errors_back <"$work/errors_back"
errors_end=$(metric delayd_far_errors_total)
corrupt=$(metric delayd_far_corrupt_frames_total)
kill -TERM "$pid" 2>/dev/null || true
wait "$pid" 2>/dev/null || true
pid=""
echo "$report" | jq -r --arg full "$errors_full" --arg back "$errors_back" --arg last "$errors_end" \
    --arg corrupt "$corrupt" '
    "\(.published) messages of 4 KiB in at \(.publish_rate | round) msg/s "
    + "| lost \(.lost) early \(.early) dup \(.duplicates) "
    + "| far errors: \($full) while full, \($back) 10 s after space came back, \($last) at the end "
    + "| corrupt frames \($corrupt)"'

#!/usr/bin/env bash
# Mutation testing of delayd's pure core with cargo-mutants: each mutant
# (an operator flipped, a function body replaced by a default, ...) must make
# some unit test fail. A surviving ("missed") mutant is a behaviour no test
# pins down. A benchmark-like command, not part of the test command: it
# builds and runs the unit tests once per mutant (hours for the whole list on
# 2 cores).
#
#   bash scripts/mutants.sh                       # the whole list below
#   bash scripts/mutants.sh src/route/delay.rs    # some files only
#   JOBS=2 bash scripts/mutants.sh                # parallel builds
#   FILTER="route:: wheel::" bash scripts/mutants.sh src/route/delay.rs src/wheel
#   ITERATE=1 bash scripts/mutants.sh ...         # only what survived last time
#
# Results: mutants.out/ (caught.txt, missed.txt, timeout.txt, unviable.txt)
# and the counts printed at the end. cargo-mutants also reads
# .cargo/mutants.toml: the mutants it excludes are equivalent ones (no test
# can tell them apart from the code), each with the reason beside it.
# TIMEOUT (seconds a mutant's tests may run; default 120) is better set low
# (e.g. TIMEOUT=20 with a FILTER): a mutant that loops forever costs that
# much.
set -euo pipefail
cd "$(dirname "$0")/.."

files=("$@")
if [ ${#files[@]} -eq 0 ]; then
    files=(src/route src/wheel src/wal/frame.rs src/wal/recovery.rs
        src/engine/dedup.rs src/engine/keys.rs)
fi
if ! cargo mutants --version >/dev/null 2>&1; then
    echo "mutants: installing cargo-mutants" >&2
    cargo install --locked cargo-mutants
fi
args=()
if [ -n "${ITERATE:-}" ]; then
    args+=(--iterate)
fi
for f in "${files[@]}"; do
    if [ -d "$f" ]; then
        args+=(--file "$f/**/*.rs" --file "$f/*.rs")
    else
        args+=(--file "$f")
    fi
done
# Only the library's unit tests, built alone (`-C --lib`: without it every
# mutant also rebuilds every integration test binary): the files above have
# no broker in them. FILTER narrows the unit tests run per mutant (e.g.
# FILTER="route:: wheel::" for those files: seconds instead of half a
# minute). No debug info: faster links, same verdicts.
# shellcheck disable=SC2086 # FILTER is a list of test name filters
CARGO_PROFILE_DEV_DEBUG=0 CARGO_PROFILE_TEST_DEBUG=0 \
    cargo mutants --package delayd --jobs "${JOBS:-1}" --timeout "${TIMEOUT:-120}" \
    -C --lib "${args[@]}" -- -- ${FILTER:-} || true
out=mutants.out
for kind in caught missed timeout unviable; do
    printf '%-9s %s\n' "$kind" "$(wc -l <"$out/$kind.txt" 2>/dev/null || echo 0)"
done
if [ -s "$out/missed.txt" ]; then
    echo "missed mutants:"
    cat "$out/missed.txt"
fi

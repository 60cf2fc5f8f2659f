#!/usr/bin/env bash
# The engine simulator (src/sim/), in release mode: seeds drive the real
# engine (WAL, wheel, far tier, redelivery detection, cancel, purge,
# compaction, kill, power loss, restart) on a manual clock and a simulated
# disk with faults, against a reference model. A failure prints its seed and
# the shortest list of operations that still fails.
#
#   bash scripts/sim.sh              # 60 seconds of seeds
#   bash scripts/sim.sh 600          # 600 seconds
#   bash scripts/sim.sh --seeds 5000 # seeds 1..5000 (SIM_FROM=N to start elsewhere)
#   SIM_SEED=42 bash scripts/sim.sh  # replay one seed, shrunk if it fails
#   SIM_THREADS=1 ...                # seeds run on every core by default
#   SIM_SOCKET=1, SIM_RELEASE=1,     # modes: deliveries unread in the socket,
#   SIM_LIMITS=1, SIM_ACKS=1 ...     # routes moving away, a config changed
#                                    # at restarts (segment size, largest
#                                    # message, compaction, load chunk,
#                                    # spill), acks in doubt confirmed later
#   SIM_SMALL=1 ...                  # segments of 160-384 bytes at every
#                                    # start (a record or three each)
#
# The test command runs a fixed budget of seeds in a debug build
# (sim::tests::a_fixed_budget_of_seeds_breaks_no_guarantee).
#
#   bash scripts/sim.sh --lock 20000 # the route lock's model instead
#                                    # (adapters/src/amqp/state/lock_model.rs):
#                                    # N seeds at a 1 s and a 5 s lease, both
#                                    # wait rules, two owners or no owner
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --lock ]; then
    export LOCK_MODEL_SEEDS="${2:-100000}"
    exec cargo test --release -p delayd-adapters --features amqp --lib lock_model::tests::long_run -- --ignored --nocapture
fi
case "${1:-}" in
    --seeds) export SIM_SEEDS="${2:?--seeds N}" ;;
    "") export SIM_SECONDS="${SIM_SECONDS:-60}" ;;
    *) export SIM_SECONDS="$1" ;;
esac
exec cargo test --release --lib sim::tests::long_run -- --ignored --nocapture

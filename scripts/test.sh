#!/usr/bin/env bash
# The test command: starts the brokers the integration tests need, then runs
# every test in the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/rabbitmq.sh
cargo test --workspace --all-features --no-fail-fast -- --test-threads=2 "$@"

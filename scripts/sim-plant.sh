#!/usr/bin/env bash
# Proves the simulator can fail: plants one bug by hand in the engine, runs
# seeds until the simulator catches it, prints how many seeds that took, and
# puts the code back. A benchmark-like command (a rebuild per bug), not part
# of the test command. Results go in docs/testing.md.
#
#   bash scripts/sim-plant.sh            # every bug below, one at a time
#   bash scripts/sim-plant.sh early      # one of them
#   SEEDS=2000 bash scripts/sim-plant.sh # give up after that many seeds
#
# Bugs: nofsync (no fsync before the ack), early (a message fired 1 ms
# early), cutback (a failed spill not cut back), cancelfar (a cancel that
# forgets the far tier), loadid (a load that keeps the old id), session (a
# redelivery compared with records of its own channel session: twins
# redelivered together are taken for one), indoubt (a redelivery equal to a
# record whose ack was in doubt taken for it: its twin is lost), noframe
# (no Remembered frame when a remembered record's segment goes: a restart
# forgets a message that left, and its late redelivery gets a new id),
# consumed (a redelivery whose copy failed to store stays matched: the next
# one gets a new id), movedone (a compaction that leaves a segment's Dones
# behind: the Schedules they retire, kept in other segments, come back at
# a restart), limit (a restart that reads frames only up to the new
# wal.max_message_bytes: a larger message stored before is taken for
# corruption; with SIM_LIMITS=1), cancelmark (a redelivery that matches a
# cancelled record is stored as new: the cancelled message fires under a
# new id), unarmed (a compaction that copies only what is armed: a
# record durable but not yet armed goes with its segment; the simulator
# settles between operations and cannot reach this one, see
# docs/testing.md), ledgerlie (the ledger of owed frames says it holds
# frames it never wrote: a restart forgets them, outside the excuse for
# frames owed in memory), ackmark (an ack's mark goes before its Schedule's
# segment: a settled record comes back in doubt; with SIM_LIMITS=1),
# copymark (a compaction copy of a record whose ack is settled written with
# no mark after it: a restart reads it back in doubt), copyhome (a
# compaction drops the ack's mark of a fired record whose compaction copy
# stands: a restart reads the copy back in doubt), keepafter (the Dones
# and marks a compaction moves on do not take over what their segment had
# to outlive: a Schedule they retire, or a record a cancel's mark covers,
# comes back at a restart). Ackmark, copymark and copyhome are caught by
# the check that a clean restart reads settled records back settled.
set -euo pipefail
cd "$(dirname "$0")/.."
seeds="${SEEDS:-1000}"
bugs=("$@")
[ ${#bugs[@]} -eq 0 ] && bugs=(nofsync early cutback cancelfar loadid session indoubt noframe consumed movedone limit cancelmark unarmed ledgerlie ackmark copymark copyhome keepafter)

# plant NAME: edit the source; each edit must apply exactly once.
plant() {
    python3 - "$1" <<'PY'
import sys
bug = sys.argv[1]
edits = {
    "nofsync": [("src/wal/writer.rs",
        "if let Err(source) = file.sync_data() {",
        "if let Err(source) = Ok::<(), std::io::Error>(()) {")],
    "early": [("src/engine/dispatch.rs",
        "state.pop_due(now, room.min(BATCH), claimed, batch);",
        "state.pop_due(now + 1, room.min(BATCH), claimed, batch);")],
    "cutback": [("src/far/mod.rs",
        "Err(e) => Err(self.cut_back(touched.into_iter(), e)),",
        "Err(e) => { drop(touched); Err(e) }"),
        ("src/far/mod.rs",
        "        if file.size().map_err(io)? > meta.bytes {",
        "        if false && file.size().map_err(io)? > meta.bytes {"),
        ("src/far/mod.rs",
        "            match fs.remove_file(&path) {\n                Ok(()) => {}",
        "            match Ok::<(), std::io::Error>(()) {\n                Ok(()) => {}")],
    "cancelfar": [("src/engine/mod.rs",
        "if near.is_some() || self.inner.far.is_none() {",
        "if true {")],
    "loadid": [("src/engine/tier.rs",
        ".append_returning(r.due_ms, r.uid, &r.route, r.message)?;",
        ".append_copy(r.id, r.due_ms, r.uid, &r.route, r.message)?;")],
    "session": [("src/engine/dedup.rs",
        "let repeatable = session == 0 || entry.session < session;",
        "let repeatable = session == 0 || entry.session <= session;")],
    "indoubt": [("src/engine/mod.rs",
        "}) if session > 0\n                    && (dedup::is_departed(id) || !self.cancelled_by_key(id, route, &message)) =>",
        "}) if false =>")],
    "noframe": [("src/engine/dedup.rs",
        "durable: !entry.confirmed && !entry.consumed,",
        "durable: false,")],
    "consumed": [("src/engine/mod.rs",
        "engine.state().unconfirmed.unconsume(taken);",
        "let _ = taken;")],
    "movedone": [("src/engine/compact.rs",
        "} => target_kept(target).then_some(Move::Done { id, target }),",
        "} => target_kept(target).then_some(()).and(None),")],
    "limit": [("src/wal/recovery.rs",
        "let scan = || Scanner::new(&buf, frame::MAX_LEN).with_last_seq(last_seq);",
        "let scan = || Scanner::new(&buf, config.max_message_bytes + 128).with_last_seq(last_seq);")],
    "cancelmark": [("src/engine/mod.rs",
        "                Some(Candidate { id, .. }) => {\n                    self.state().unconfirmed.rebind(id, session);",
        "                Some(Candidate { cancelled: true, .. }) => {}\n                Some(Candidate { id, .. }) => {\n                    self.state().unconfirmed.rebind(id, session);")],
    "ledgerlie": [("src/wal/ledger.rs",
        ".write_at(&bytes, offset)",
        ".write_at(&bytes[..0], offset)")],
    "ackmark": [("src/wal/segments.rs",
        "        if marked >= own {",
        "        if true || marked >= own {"),
        ("src/engine/compact.rs",
        "if id & (dedup::CANCELLED_MARK | dedup::MATCHED_MARK) == 0",
        "if false && id & (dedup::CANCELLED_MARK | dedup::MATCHED_MARK) == 0")],
    "copymark": [("src/engine/compact.rs",
        "mark_after: state.unconfirmed.mark_for_copy(id),",
        "mark_after: None,"),
        ("src/engine/compact.rs",
        "state.unconfirmed.mark_for_copy(id).filter(|_| !marked)",
        "state.unconfirmed.mark_for_copy(id).filter(|_| false)")],
    "copyhome": [("src/engine/compact.rs",
        ".or_else(|| inner.wal.copy_mark_home(segment, id));",
        ";")],
    "keepafter": [("src/engine/compact.rs",
        "        inner.wal.keep_after(appended.pos.segment, segment);\n    }\n    let mut late_dones",
        "    }\n    let mut late_dones")],
    "unarmed": [("src/engine/compact.rs",
        "if located < inner.wal.segment_live(segment) {",
        "if false && located < inner.wal.segment_live(segment) {")],
}
for path, old, new in edits[bug]:
    text = open(path).read()
    assert text.count(old) == 1, f"{bug}: {path} does not hold the line to change once"
    open(path, "w").write(text.replace(old, new))
PY
}

for bug in "${bugs[@]}"; do
    if ! git diff --quiet -- src; then
        echo "sim-plant: src/ has uncommitted changes; commit or stash them first" >&2
        exit 2
    fi
    plant "$bug"
    echo "sim-plant: $bug planted; running up to $seeds seeds"
    set +e
    # SIM_SOCKET: deliveries may wait unread in a socket (the session bug
    # needs twins redelivered together).
    # SIM_LIMITS: the config may change at restarts (the limit bug needs a
    # lower wal.max_message_bytes).
    limits=0
    [ "$bug" = limit ] || [ "$bug" = ackmark ] || [ "$bug" = ledgerlie ] || [ "$bug" = copyhome ] && limits=1
    # SIM_ACKS: acks in doubt confirmed later (the copyhome bug needs a
    # mark written after a compaction copied its record).
    acks=0
    [ "$bug" = copyhome ] && acks=1
    out=$(SIM_SOCKET=1 SIM_LIMITS=$limits SIM_ACKS=$acks SIM_SEEDS="$seeds" cargo test --lib sim::tests::long_run -- --ignored --nocapture 2>&1)
    status=$?
    set -e
    git checkout -q -- src
    if [ $status -eq 0 ]; then
        echo "sim-plant: $bug NOT caught in $seeds seeds"
    else
        line=$(grep -m1 -E '^seed [0-9]+ step' <<<"$out" || grep -m1 -E 'panicked|error' <<<"$out")
        echo "sim-plant: $bug caught: $line"
    fi
done

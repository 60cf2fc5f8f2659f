"""One line per fault scenario from `delayd bench --json`, and its verdict.

    report.py SCENARIO CYCLES SECONDS DUP_PERMILLE REPORT.json
              [--owners SAMPLES --replicas N]

Pass: 0 lost, 0 early, duplicates at most DUP_PERMILLE per mille of the
messages received, no copy under another x-delayd-id than the first
copy's (a copy can then only be the same stored message sent again), in
every scenario. Twins (the bench's --twins: the same bytes published twice)
must each arrive: a lost twin copy fails the scenario (issue #37). Twins whose second copy
arrived under the first one's id (kept so while the first one's ack was in
doubt) are listed. With --owners (lines "epoch-seconds A B A B", each 1 when that
instance owned the route, read in that order, from scripts/cluster-faults.sh):
never two owners at once, and the route's state streams on --replicas nodes,
which must be 3.

The reads of one sample are tens of milliseconds apart, and a hand-over
takes less: "A owned, then B did" is not two owners. Two owners are a
reading of 1 between two of the other instance's that are both 1 (it owned
before and after, so throughout). Lines of one A and one B (older runs)
count when both are 1.
Exit status 0 on a pass.
"""
import argparse
import json
import sys

p = argparse.ArgumentParser()
p.add_argument("scenario")
p.add_argument("cycles", type=int)
p.add_argument("seconds", type=int)
p.add_argument("dup_permille", type=int)
p.add_argument("report")
p.add_argument("--owners")
p.add_argument("--replicas", type=int, default=0)
a = p.parse_args()

try:
    r = json.load(open(a.report))
except Exception as e:
    print(f"{a.scenario:12} FAIL: no bench report ({e})")
    sys.exit(1)

dup_rate = r["duplicates"] / max(r["received"], 1)
other_id = r["duplicates_different_id"]
twins_lost = r.get("twin_copies_lost", 0)
ok = (r["lost"] == 0 and r["early"] == 0 and dup_rate <= a.dup_permille / 1000
      and other_id == 0 and twins_lost == 0)
owners = ""
if a.owners:
    both = 0
    longest_gap = 0.0
    owned_at = None  # the last sample that found an owner
    for line in open(a.owners):
        t, *reads = line.split()
        t = float(t)
        owned = [r == "1" for r in reads]
        if len(owned) == 2:
            both += owned[0] and owned[1]
        else:
            both += any(owned[i - 1] and owned[i] and owned[i + 1]
                        for i in range(1, len(owned) - 1))
        if any(owned):
            if owned_at is not None:
                longest_gap = max(longest_gap, t - owned_at)
            owned_at = t
    ok = ok and both == 0 and a.replicas == 3
    owners = (f"  two owners {both} samples, longest without an owner {longest_gap:.1f} s,"
              f" state stream replicas {a.replicas}")
print(f"{a.scenario:12} {'ok  ' if ok else 'FAIL'} cycles {a.cycles:>3}  published {r['published']:>7}"
      f" (+{r['publish_failures']} unconfirmed)  received {r['received']:>7}  lost {r['lost']}"
      f"  early {r['early']}  duplicates {r['duplicates']} ({100 * dup_rate:.3f} %:"
      f" same id {r['duplicates_same_id']}, different id {other_id};"
      f" +{r['redelivered_to_bench']} redelivered to the bench)"
      f"  p99 {r['lateness_p99_ms']} ms  max {r['lateness_max_ms']} ms{owners}  {a.seconds} s")
if r.get("lateness_by_stamp_p99_ms") is not None:
    # What delayd counts from: the broker's stamp. The difference is how
    # long the broker took to take a publish in (a node draining, a
    # connection moving), which delayd cannot see.
    print(f"{'':12} from the broker's stamp: p99 {r['lateness_by_stamp_p99_ms']} ms"
          f"  max {r['lateness_by_stamp_max_ms']} ms  early {r.get('early_by_stamp', 0)}")
if r.get("twins"):
    print(f"{'':12} twins {r['twins']}, copies lost {r['twin_copies_lost']},"
          f" under one id {r.get('twins_under_one_id', 0)}"
          + (f" (lost: seqs {r['twin_lost_examples'][:10]})" if r.get("twin_lost_examples") else ""))
if twins_lost:
    print(f"{'':12} FAIL: {twins_lost} twin copies lost: a message published twice as the"
          f" same bytes arrived once (issue #37)")
if r.get("different_id_examples"):
    print(f"{'':12} different-id copies (seq, first id, other id): {r['different_id_examples'][:5]}")
if other_id > 0:
    print(f"{'':12} FAIL: {other_id} copies under another x-delayd-id (issue #40)")
sys.exit(0 if ok else 1)

#!/usr/bin/env bash
# The cluster fault campaign: delayd on the three-node RabbitMQ 4.3 cluster
# (RABBITMQ=cluster scripts/rabbitmq.sh), under steady load, while nodes die.
# Every message is accounted for by `delayd bench` (delivered once,
# duplicated under the same or another x-delayd-id, lost, early).
#
# The store scenarios run two delayd instances on one route with
# store.kind = "broker" (a quorum ingress queue, the lock queue and the
# replicated state streams), instance A given the nodes in the order 1, 2, 3
# and B in the order 2, 3, 1. A watcher reads both instances' /readyz every
# 100 ms: the two must never both own the route.
#
#   conn-node    kill -9 of the node that holds the owner's connections,
#                then the node started again
#   lock-leader  kill -9 of the node that leads the route's lock queue,
#                then the node started again
#   rolling      each node in turn stopped cleanly and started again
#   rolling-drain
#                the same, each node first put in maintenance mode
#                (`rabbitmq-upgrade drain`, as the Kubernetes cluster
#                operator's preStop hook does): its quorum leaders and the
#                stream coordinator's leadership move off it, and its
#                clients are disconnected, before it stops. Not among the
#                default scenarios
#   lock-pause   the node that leads the lock queue frozen (SIGSTOP) for
#                PAUSE seconds (default 2), then resumed: a stall, not a
#                death. Logs how many times an instance gave the lock up (a
#                stall longer than the lease moves it: a restore, no loss).
#                Not among the default scenarios
#   conn-cut     the link between the owner and the node its connections go
#                to cut for 15 s while both live (iptables drops what the
#                owner sends to that node, its reconnects included; the
#                instances run in cgroups of their own for the match), then
#                restored; the instances' heartbeat is 5 s
#   conn-flap    the same link cut for 1 s and up for 1 s, for FLAP seconds
#                (default 60, 30 in the short run); heartbeat 5 s
#   node-cut     the node the owner is connected to cut off from the other
#                two for 15 s (Erlang distribution and stream replication,
#                both ways) while every process lives and the owner's
#                connection stays up: the node is in the minority. RabbitMQ
#                4.3 keeps its metadata in Khepri (Raft), whose minority
#                behaves like `pause_minority`: it takes no writes
#   lock-cut     the link between the owner's node and the lock queue's
#                leader's node cut for 15 s (the third node still reaches
#                both); when the two are one node, the lock's leadership is
#                first moved to another node
#   redeploy     the owning delayd instance stopped with SIGTERM and started
#                again, then the new owner the same (a Deployment's rolling
#                update): the owner hands the route over, and the standby
#                owns it without waiting out the lease
#   classic-node one instance, the local store, a route on a classic ingress
#                queue whose node is killed with kill -9: delayd waits for
#                the queue, and resumes once its node is back
#
#   bash scripts/cluster-faults.sh            # 2,000 msg/s, delays 5-60 s, 3 cycles of each
#   bash scripts/cluster-faults.sh --short    # 200 msg/s, delays 5-20 s, 1 cycle (part of scripts/test.sh)
#   SCENARIOS="rolling" CYCLES=2 RATE=1000 bash scripts/cluster-faults.sh
#   KEEP=1 ...                                # keep delayd's logs, the owner samples and
#                                             # <scenario>.late (messages a second or more late:
#                                             # seq, due, arrived, due by the broker's stamp + x-delay)
#   LOG="info,delayd::runtime::ingest=debug"  # delayd's log level (each message's intake)
#   LEASE=1s ...                              # store.lease of the store scenarios (default 5s)
#   INGRESS=stream ...                        # the store scenarios' ingress queue type (default
#                                             # quorum; a stream has no deliveries in doubt)
#
# The cuts (conn-cut, conn-flap, node-cut, lock-cut) need cgroup v2 (the
# unified hierarchy) and iptables' cgroup and connmark matches; without them
# they are skipped, saying so. The nodes and the instances all live on
# loopback, so a link is told apart by the sending process's cgroup (each
# instance and, for a cut, each node's VM has one of its own) and the
# receiving side's ports.
#
# Pass: 0 lost and 0 early, never two owners at once, the state streams on
# all three nodes, duplicates under another x-delayd-id than the first copy's
# 0 (classic-node: listed, as the README's named case of a broker node that
# crashed just after delayd's ack), all duplicates at most 0.1 % of the
# messages received (8 % in the short run), and no instance holding any of
# the route's messages once every one arrived. The bench publishes each message once
# (a publish whose confirm is lost is not sent again, only counted
# unconfirmed), so every further copy is delayd's.
# Lost counts only publishes the broker confirmed; early is judged against
# the bench's clock at publish. It stops and starts the cluster's nodes, so
# run it alone, not beside the integration tests.
set -euo pipefail
cd "$(dirname "$0")/.."

short=false
[ "${1:-}" = "--short" ] && short=true
if $short; then
    # Same-id copies: a lock lost while publishes to a target whose leader
    # died wait for their confirms; the next owner sends them again. 0.2 to
    # 0.7 % of a short lock-leader run (measured 2026-11-27), but 1.0 and
    # 3.5 % beside a build (2026-11-28): what was in flight at the fault,
    # about 1.5 s of the load. A copy under one id is the contract's
    # acceptable duplicate, so the cap guards against a regression (several
    # seconds of the load sent twice), not against load: 8 %.
    default_cycles=1 rate="${RATE:-200}" delay_max=20000 dup_permille=80
else
    default_cycles=3 rate="${RATE:-2000}" delay_max=60000 dup_permille=1
fi
delay_min=5000
cycles="${CYCLES:-$default_cycles}"
scenarios="${SCENARIOS:-conn-node lock-leader rolling redeploy conn-cut conn-flap node-cut lock-cut classic-node}"
flap="${FLAP:-$($short && echo 30 || echo 60)}"
ports=(5681 5682 5683)

# jq reads /readyz and rabbitmqctl's JSON; ss finds a process's connections;
# iptables cuts a link (conn-cut).
if ! command -v jq >/dev/null || ! command -v ss >/dev/null || ! command -v iptables >/dev/null; then
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO=sudo
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -qq jq iproute2 iptables >/dev/null 2>&1 ||
        { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq jq iproute2 iptables >/dev/null; }
fi
RABBITMQ=cluster bash scripts/rabbitmq.sh >/dev/null
if $short; then
    cargo build --quiet
    delayd="$PWD/target/debug/delayd"
else
    cargo build --release --quiet
    delayd="$PWD/target/release/delayd"
fi
work="$(mktemp -d /var/tmp/delayd-cluster-faults.XXXXXX)"
tag="$(date +%s)"
declare -A pids=()
watcher=""
failed=0
passed=0

log() { echo "cluster-faults: $*" >&2; }
node() { echo "delayd-c$1@localhost"; }
cluster() { bash scripts/rabbitmq.sh "$@" >/dev/null; }
# rabbitmqctl and friends against any node that answers.
ctl() { # command...
    local tool="$1" n
    shift
    for n in 1 2 3; do
        if "$tool" -q -n "$(node "$n")" "$@" 2>/dev/null; then return 0; fi
    done
    return 1
}

stop_all() {
    [ -n "$watcher" ] && kill "$watcher" 2>/dev/null
    watcher=""
    for i in "${!pids[@]}"; do
        kill -TERM "${pids[$i]}" 2>/dev/null || true
    done
    for i in "${!pids[@]}"; do
        for _ in $(seq 1 300); do kill -0 "${pids[$i]}" 2>/dev/null || break; sleep 0.1; done
        kill -9 "${pids[$i]}" 2>/dev/null || true
        { wait "${pids[$i]}"; } 2>/dev/null || true
        unset "pids[$i]"
    done
}

# Instance $1's cgroup (cgroup v2, for iptables' `-m cgroup --path`).
cgroup_root=/sys/fs/cgroup/unified
[ -f /sys/fs/cgroup/cgroup.controllers ] && cgroup_root=/sys/fs/cgroup
cgroup_of() { echo "delayd-cfaults-$tag-$1"; }
cuts=()

uncut_all() {
    local rule
    for rule in ${cuts[@]+"${cuts[@]}"}; do
        # shellcheck disable=SC2086 # a rule is words
        iptables -D OUTPUT $rule 2>/dev/null || true
    done
    cuts=()
}

cleanup() {
    uncut_all
    stop_all
    for i in 1 2; do rmdir "$cgroup_root/$(cgroup_of "$i")" 2>/dev/null || true; done
    unplace_nodes
    # Every node up again, whatever a failed scenario left down.
    for n in 1 2 3; do cluster cluster-start "$n" 2>/dev/null || true; done
    ctl rabbitmqctl list_queues name --no-table-headers | grep "^cfaults\.$tag\." |
        while read -r q; do ctl rabbitmqctl delete_queue "$q" >/dev/null || true; done
    if [ -n "${KEEP:-}" ]; then log "logs kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

# --- delayd ------------------------------------------------------------

http_port() { echo $((9480 + $1)); }

write_config() { # scenario, instance (1 = A, 2 = B), node order...
    local s="$1" i="$2"
    shift 2
    local urls="" n query=""
    # A cut link is noticed by the node only after the heartbeat timeout.
    case "$s" in conn-cut | conn-flap) query="?heartbeat=5" ;; esac
    for n in "$@"; do urls+="\"amqp://guest:guest@127.0.0.1:${ports[$((n - 1))]}/%2f$query\", "; done
    local store="" queue_type="${INGRESS:-quorum}"
    if [ "$s" = classic-node ]; then
        queue_type="classic"
    else
        store=$'[store]\nkind = "broker"\ntopic_prefix = "cfaults.'"$tag.$s"$'."\ncheckpoint_records = 5000\n'
        [ -z "${LEASE:-}" ] || store+="lease = \"$LEASE\""$'\n'
    fi
    cat >"$work/$s-$i.toml" <<EOF
[wal]
dir = "$work/$s-$i-wal"
create_dir = true

[http]
listen = "127.0.0.1:$(http_port "$i")"

$store
[log]
level = "${LOG:-info}"

[brokers.rabbit]
kind = "amqp"
urls = [${urls%, }]

[[routes]]
name = "cf-$s"
from = { broker = "rabbit", queue = "cfaults.$tag.$s.in", exchange = "cfaults.$tag.$s.delayed", queue_type = "$queue_type", prefetch = 500 }
to = { broker = "rabbit", exchange = "cfaults.$tag.$s.out" }
EOF
}

start_delayd() { # scenario, instance
    # In a cgroup of its own (when there is cgroup v2): its sockets carry
    # it, and conn-cut's iptables rule matches them by it.
    local cg="$cgroup_root/$(cgroup_of "$2")"
    mkdir -p "$cg" 2>/dev/null || true
    (
        [ -w "$cg/cgroup.procs" ] && echo "$BASHPID" >"$cg/cgroup.procs" 2>/dev/null
        cd "$work" && exec "$delayd" run --config "$work/$1-$2.toml" >>"$work/$1-$2.log" 2>&1
    ) &
    pids[$2]=$!
    for _ in $(seq 1 150); do
        curl -sf "http://127.0.0.1:$(http_port "$2")/healthz" >/dev/null && return 0
        sleep 0.2
    done
    log "delayd $2 did not start; its log:"
    tail -n 30 "$work/$1-$2.log" >&2
    return 1
}

# Whether instance $2 owns route cf-$1 now: 1, 0, or - (no answer).
owns() {
    curl -s -m 1 "http://127.0.0.1:$(http_port "$2")/readyz" 2>/dev/null |
        jq -r --arg r "cf-$1" '.store.routes[$r].owner | if . == true then 1 elif . == false then 0 else "-" end' 2>/dev/null |
        grep . || echo -
}

# Each sample reads instance 1, 2, 1, 2: the reads are tens of ms apart and a
# hand-over is faster, so scripts/faults/report.py counts two owners only
# where one instance owned before and after a reading of the other's.
watch_owners() { # scenario
    while :; do
        echo "$(date +%s.%N) $(owns "$1" 1) $(owns "$1" 2) $(owns "$1" 1) $(owns "$1" 2)"
        sleep 0.1
    done >"$work/$1.owners"
}

# Waits until an instance consumes route cf-$1 (60 s at most).
consuming() {
    local i
    for _ in $(seq 1 300); do
        for i in 1 2; do
            curl -s -m 1 "http://127.0.0.1:$(http_port "$i")/readyz" 2>/dev/null |
                jq -e --arg r "cf-$1" '.routes[$r] == "consuming"' >/dev/null 2>&1 && return 0
        done
        sleep 0.2
    done
    return 1
}

owner() { # scenario: the instance that owns the route (waits for one)
    for _ in $(seq 1 300); do
        for i in 1 2; do
            [ "$(owns "$1" "$i")" = 1 ] && { echo "$i"; return 0; }
        done
        sleep 0.2
    done
    return 1
}

# The cluster node most of instance $1's AMQP connections go to.
connected_node() {
    local pid="${pids[$1]}" port
    port=$(ss -tnpH state established 2>/dev/null | grep "pid=$pid," |
        awk '{ n = split($4, a, ":"); print a[n] }' | grep -E '^568[123]$' |
        sort | uniq -c | sort -rn | awk 'NR == 1 { print $2 }')
    [ -n "$port" ] && echo $((port - 5680))
}

lock_leader() { # scenario
    ctl rabbitmqctl list_queues name leader --formatter json |
        jq -r --arg q "cfaults.$tag.$1.cf-$1.lock" '.[] | select(.name == $q) | .leader' |
        sed -n 's/^delayd-c\([123]\)@.*/\1/p'
}

# A node down long enough for the route to move, then back, and in the
# cluster again before the next fault.
node_down() { # node, how (kill | stop)
    log "node $1: $2"
    cluster "cluster-$2" "$1"
    sleep 12
    cluster cluster-start "$1"
    log "node $1: back"
    sleep 8
}

inject_conn-node() {
    local o n
    o=$(owner "$1") || { log "no owner"; return 1; }
    n=$(connected_node "$o") || { log "instance $o has no connection"; return 1; }
    log "owner $o is connected to node $n"
    node_down "$n" kill
}
# Cut what instance $1 sends to node $2 (established connections and new
# ones): without its ACKs and heartbeats the node closes the connection
# after the heartbeat timeout; the process lives on.
cut() { # instance, node
    local rule="-p tcp --dport ${ports[$(($2 - 1))]} -m cgroup --path $(cgroup_of "$1") -j DROP"
    # shellcheck disable=SC2086
    iptables -I OUTPUT $rule && cuts+=("$rule")
}
inject_conn-cut() {
    local o n
    o=$(owner "$1") || { log "no owner"; return 1; }
    n=$(connected_node "$o") || { log "instance $o has no connection"; return 1; }
    log "owner $o is connected to node $n: cutting the link for 15 s"
    cut "$o" "$n" || { log "iptables refused the cut"; return 1; }
    sleep 15
    uncut_all
    log "link $o-$n: back"
    sleep 10
}
inject_conn-flap() {
    local o n i
    o=$(owner "$1") || { log "no owner"; return 1; }
    n=$(connected_node "$o") || { log "instance $o has no connection"; return 1; }
    log "owner $o is connected to node $n: the link flaps (1 s cut, 1 s up) for $flap s"
    for i in $(seq 1 $((flap / 2))); do
        cut "$o" "$n" || { log "iptables refused the cut"; return 1; }
        sleep 1
        uncut_all
        sleep 1
    done
    log "link instance $o - node $n: steady"
    sleep 10
}

# Links between nodes. Node $1's VM listens on its distribution port; for
# a cut it moves into a cgroup of its own, so that what it sends can be
# told from what the other nodes send.
node_cgroup() { echo "delayd-cfaults-$tag-node$1"; }
node_vm() {
    ss -tlnpH "sport = :$((25680 + $1))" 2>/dev/null | sed -n 's/.*pid=\([0-9]*\),.*/\1/p' | head -n 1
}
place_node() {
    local cg pid
    cg="$cgroup_root/$(node_cgroup "$1")"
    pid=$(node_vm "$1")
    [ -n "$pid" ] && mkdir -p "$cg" && echo "$pid" >"$cg/cgroup.procs"
}
unplace_nodes() {
    local n cg p
    for n in 1 2 3; do
        cg="$cgroup_root/$(node_cgroup "$n")"
        [ -d "$cg" ] || continue
        while read -r p; do echo "$p" >"$cgroup_root/cgroup.procs" 2>/dev/null || true; done <"$cg/cgroup.procs"
        rmdir "$cg" 2>/dev/null || true
    done
}
# The established connections node $1's VM opened to node $2's
# distribution port or stream replication ports: "local-port peer-port".
node_links() { # from, to
    local pid="$(node_vm "$1")" to="$2"
    ss -tnpH state established 2>/dev/null | grep "pid=$pid," |
        awk -v d=$((25680 + to)) -v lo=$((6000 + to * 100)) -v hi=$((6099 + to * 100)) '{
            n = split($3, l, ":"); m = split($4, p, ":")
            if (p[m] == d || (p[m] >= lo && p[m] <= hi)) print l[n], p[m]
        }'
}
# Cut the link between nodes $1 and $2, both ways, silently (no reset: as
# a partition, not a crash). Every packet of a connection between them is
# dropped, the replies too: a connection is marked (conntrack) by the
# first packet a rule below matches. The rules: each connection open now,
# by its ports (a socket keeps the cgroup it was made in, so the nodes'
# cgroups cannot tell them); and each new one, by the sending node's
# cgroup and the other node's ports. A mark of its own per cut, so that a
# later cut never takes connections an earlier one marked.
marks=0
cut_nodes() { # node, node
    place_node "$1" && place_node "$2" || { log "node $1 or $2 has no VM to cut"; return 1; }
    marks=$((marks + 1))
    local mark=$((0x4400 + marks)) rule from to sport dport open=0
    rule="-m connmark --mark $mark -j DROP"
    # shellcheck disable=SC2086 # a rule is words
    iptables -I OUTPUT $rule && cuts+=("$rule") || return 1
    for from in "$1" "$2"; do
        to=$(($1 + $2 - from))
        rule="-p tcp -m multiport --dports $((25680 + to)),$((6000 + to * 100)):$((6099 + to * 100))"
        rule+=" -m cgroup --path $(node_cgroup "$from") -j CONNMARK --set-mark $mark"
        # shellcheck disable=SC2086
        iptables -I OUTPUT $rule && cuts+=("$rule") || return 1
        while read -r sport dport; do
            rule="-p tcp --sport $sport --dport $dport -j CONNMARK --set-mark $mark"
            # shellcheck disable=SC2086
            iptables -I OUTPUT $rule && cuts+=("$rule") && open=$((open + 1)) || return 1
        done < <(node_links "$from" "$to")
    done
    [ "$open" -gt 0 ] || { log "no connection between nodes $1 and $2 to cut"; return 1; }
}
# Packets the cuts' connmark rules dropped so far (a cut that dropped
# nothing cut nothing, and fails its scenario).
dropped() {
    iptables -L OUTPUT -v -n -x 2>/dev/null | awk '$3 == "DROP" && /connmark match/ { n += $1 } END { print n + 0 }'
}
# Heal the cuts, once they have shown to drop something.
heal_nodes() { # what
    local n
    n=$(dropped)
    uncut_all
    log "$1: links back ($n packets between the nodes dropped)"
    [ "$n" -gt 0 ]
}
inject_node-cut() {
    local o n m
    o=$(owner "$1") || { log "no owner"; return 1; }
    n=$(connected_node "$o") || { log "instance $o has no connection"; return 1; }
    log "owner $o is connected to node $n: node $n cut off from the other two for 15 s"
    for m in 1 2 3; do
        [ "$m" = "$n" ] || cut_nodes "$n" "$m" || { uncut_all; return 1; }
    done
    sleep 15
    heal_nodes "node $n" || return 1
    sleep 15
}
inject_lock-cut() {
    local o n l m
    o=$(owner "$1") || { log "no owner"; return 1; }
    n=$(connected_node "$o") || { log "instance $o has no connection"; return 1; }
    l=$(lock_leader "$1")
    [ -n "$l" ] || { log "no leader for the lock queue"; return 1; }
    if [ "$l" = "$n" ]; then
        # Another node than the owner's, and not the bench's (node 3) when
        # there is a choice.
        for m in 1 2 3; do [ "$m" != "$n" ] && { l=$m; break; }; done
        log "the lock queue's leader is the owner's node $n: moving it to node $l"
        ctl rabbitmq-queues transfer_leadership "cfaults.$tag.$1.cf-$1.lock" "$(node "$l")" >/dev/null ||
            { log "transfer_leadership refused"; return 1; }
        for _ in $(seq 1 50); do [ "$(lock_leader "$1")" = "$l" ] && break; sleep 0.2; done
        [ "$(lock_leader "$1")" = "$l" ] || { log "the lock queue's leader did not move"; return 1; }
    fi
    log "owner $o is connected to node $n, the lock queue's leader is node $l: cutting $n-$l for 15 s"
    cut_nodes "$n" "$l" || { uncut_all; return 1; }
    sleep 15
    heal_nodes "link $n-$l" || return 1
    sleep 15
}
can_cut() {
    command -v iptables >/dev/null && [ -d "$cgroup_root" ] &&
        mkdir -p "$cgroup_root/$(cgroup_of probe)" 2>/dev/null &&
        iptables -I OUTPUT -p tcp --dport 1 -m cgroup --path "$(cgroup_of probe)" -j DROP 2>/dev/null &&
        iptables -D OUTPUT -p tcp --dport 1 -m cgroup --path "$(cgroup_of probe)" -j DROP &&
        iptables -I OUTPUT -p tcp --dport 1 -j CONNMARK --set-mark 0x4400 2>/dev/null &&
        iptables -D OUTPUT -p tcp --dport 1 -j CONNMARK --set-mark 0x4400 &&
        iptables -I OUTPUT -p tcp --dport 1 -m connmark --mark 0x4400 -j DROP 2>/dev/null &&
        iptables -D OUTPUT -p tcp --dport 1 -m connmark --mark 0x4400 -j DROP &&
        rmdir "$cgroup_root/$(cgroup_of probe)"
}
inject_lock-pause() {
    local n lost
    n=$(lock_leader "$1")
    [ -n "$n" ] || { log "no leader for the lock queue"; return 1; }
    log "node $n (the lock queue's leader): paused for ${PAUSE:-2} s"
    bash scripts/rabbitmq.sh cluster-pause "$n" "${PAUSE:-2}" >/dev/null
    log "node $n: resumed"
    sleep 20
    lost=$(cat "$work/$1"-[12].log | grep -c "lost the route's lock" || true)
    log "$1: the lock was given up $lost times so far (lease ${LEASE:-5s})"
}
inject_lock-leader() {
    local n
    n=$(lock_leader "$1")
    [ -n "$n" ] || { log "no leader for the lock queue"; return 1; }
    node_down "$n" kill
}
inject_rolling() {
    for n in 1 2 3; do node_down "$n" stop; done
}
inject_rolling-drain() {
    for n in 1 2 3; do
        log "node $n: drain"
        rabbitmq-upgrade -q -n "$(node "$n")" drain >/dev/null ||
            { log "node $n: drain refused"; return 1; }
        node_down "$n" stop
        # A drained node stays in maintenance across its restart.
        rabbitmq-upgrade -q -n "$(node "$n")" revive >/dev/null ||
            { log "node $n: revive refused"; return 1; }
    done
}
inject_redeploy() {
    local o k
    for k in 1 2; do
        o=$(owner "$1") || { log "no owner"; return 1; }
        log "instance $o (the owner): SIGTERM"
        kill -TERM "${pids[$o]}"
        for _ in $(seq 1 600); do kill -0 "${pids[$o]}" 2>/dev/null || break; sleep 0.1; done
        kill -0 "${pids[$o]}" 2>/dev/null && { log "instance $o did not stop within 60 s"; return 1; }
        wait "${pids[$o]}" || { log "instance $o did not exit cleanly"; return 1; }
        grep -h "handed over" "$work/$1-$o.log" | tail -n 1 >&2 || true
        sleep 2
        start_delayd "$1" "$o" || return 1
        log "instance $o: started again"
        sleep 15
    done
}
inject_classic-node() {
    # The classic queue lives on the node delayd declared it through.
    local n
    n=$(ctl rabbitmqctl list_queues name leader --formatter json |
        jq -r --arg q "cfaults.$tag.$1.in" '.[] | select(.name == $q) | .leader' |
        sed -n 's/^delayd-c\([123]\)@.*/\1/p')
    [ -n "$n" ] || { log "the ingress queue has no node"; return 1; }
    node_down "$n" kill
}

# Seconds one cycle of each fault takes (node_down is about 30 s, a cut
# 25 s).
fault_seconds() {
    case "$1" in
    rolling | rolling-drain) echo 100 ;;
    conn-flap) echo $((flap + 15)) ;;
    node-cut | lock-cut) echo 40 ;;
    redeploy) echo 45 ;;
    *) echo 35 ;;
    esac
}

# --- one scenario ----------------------------------------------------------

run_scenario() { # scenario
    local s="$1" instances=(1 2)
    [ "$s" = classic-node ] && instances=(1)
    case "$s" in
    conn-cut | conn-flap | node-cut | lock-cut)
        if ! can_cut; then
            log "$s: skipped (needs cgroup v2 at $cgroup_root and iptables' cgroup and connmark matches)"
            return 0
        fi
        ;;
    esac
    write_config "$s" 1 1 2 3
    write_config "$s" 2 2 3 1
    for i in "${instances[@]}"; do start_delayd "$s" "$i" || return 1; done
    for _ in $(seq 1 300); do
        curl -sf "http://127.0.0.1:$(http_port 1)/readyz" >/dev/null && break
        sleep 0.2
    done
    # The owner declares the route's exchange once it consumes: the bench
    # refuses to publish to one that does not exist yet (a standby is ready
    # before that).
    consuming "$s" || { log "$s: no instance consumes the route"; stop_all; return 1; }
    [ "$s" = classic-node ] || { watch_owners "$s" & watcher=$!; }
    local seconds=$((cycles * $(fault_seconds "$s") + 10))
    local count=$((rate * seconds))
    local start=$SECONDS
    # The bench on node 1 first; on node 3 first where a node is cut off,
    # which is the owner's (mostly node 1 or 2): its own consumer stalled
    # behind a cut would be counted as delayd's lateness.
    local bench_nodes=(1 2 3) urls=() n
    case "$s" in node-cut | lock-cut) bench_nodes=(3 2 1) ;; esac
    for n in "${bench_nodes[@]}"; do urls+=(--url "amqp://guest:guest@127.0.0.1:${ports[$((n - 1))]}/%2f"); done
    timeout "$((seconds + delay_max / 1000 + 400))" "$delayd" bench --quiet --json "${urls[@]}" \
        --exchange "cfaults.$tag.$s.delayed" --queue "cfaults.$tag.$s.out.q" --queue-type quorum \
        --bind-to "cfaults.$tag.$s.out" --count "$count" --rate "$rate" \
        --delay-min "$delay_min" --delay-max "$delay_max" --body-bytes 256 --in-flight 1000 \
        --drain-timeout 240s --late-log "$work/$s.late" >"$work/$s.json" 2>"$work/$s.bench.log" &
    local bench=$!
    sleep 5
    local ok=0
    for c in $(seq 1 "$cycles"); do
        if ! "inject_$s" "$s"; then ok=1; break; fi
        log "$s: cycle $c/$cycles done"
    done
    wait "$bench" || true
    local took=$((SECONDS - start))
    local held
    held=$(left_behind "$s" "${instances[@]}")
    stop_all
    [ "$ok" = 0 ] || return 1
    [ -s "$work/$s.json" ] || { log "$s: the bench reported nothing:"; tail -n 20 "$work/$s.bench.log" >&2; }

    # The route's streams replicated on every node (store scenarios).
    local members=3
    if [ "$s" != classic-node ]; then
        members=$(stream_members "cfaults.$tag.$s.cf-$s")
    fi
    # One identity per message in every scenario: a classic queue's node
    # that dies with delayd's last acks not yet written down redelivers
    # those messages, and delayd stores them again under their own ids
    # (issue #40).
    local store=()
    [ "$s" = classic-node ] || store=(--owners "$work/$s.owners" --replicas "$members")
    python3 scripts/faults/report.py "$s" "$cycles" "$took" "$dup_permille" "$work/$s.json" ${store[@]+"${store[@]}"} || return 1
    [ -z "$held" ] || { log "$s: messages left behind after every one arrived:$held"; return 1; }
}

# The members of stream $1, as the first node that answers reports them:
# asked of each node in turn for up to about a minute, since a node just
# restarted can refuse (a long conn-node run read 0 from node 1, killed
# and back a minute before). Prints the most seen (0: no node answered).
stream_members() {
    local n m best=0
    for _ in $(seq 1 8); do
        for n in 1 2 3; do
            m=$(rabbitmq-streams -q -n "$(node "$n")" stream_status "$1" --formatter json 2>/dev/null |
                jq 'length' 2>/dev/null) || m=0
            [ "${m:-0}" -gt "$best" ] && best=$m
            [ "$best" -ge 3 ] && { echo "$best"; return 0; }
        done
        sleep 3
    done
    echo "$best"
}

# Once the bench has every message, no instance may hold one of the route's
# (a former owner that kept one fires it again the next time it owns the
# route). Prints what each instance still holds after 10 s, if anything.
left_behind() { # scenario, instances...
    local s="$1" i k
    shift
    for i in "$@"; do
        for _ in $(seq 1 50); do
            k=$(curl -s -m 1 "http://127.0.0.1:$(http_port "$i")/metrics" |
                awk -v r="delayd_pending_messages{route=\"cf-$s\"}" '$1 == r { print $2 }')
            [ "${k:-0}" = 0 ] && break
            sleep 0.2
        done
        [ "${k:-0}" = 0 ] || echo -n " instance $i holds $k"
    done
}

for s in $scenarios; do
    if run_scenario "$s"; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
        for f in "$work/$s"-*.log; do cp "$f" "/var/tmp/delayd-cluster-faults-$(basename "$f")" 2>/dev/null || true; done
        log "$s failed; delayd's logs: /var/tmp/delayd-cluster-faults-$s-*.log"
    fi
done
echo "cluster-faults: $passed scenarios ok, $failed failed"
[ "$failed" -eq 0 ]

#!/usr/bin/env bash
# The RabbitMQ that delayd's tests and quick start use, on 127.0.0.1 (guest/guest).
#
#   scripts/rabbitmq.sh [start]       start it, or reuse the one already running
#   scripts/rabbitmq.sh stop          stop it
#   scripts/rabbitmq.sh restart
#   scripts/rabbitmq.sh status
#   scripts/rabbitmq.sh cluster-stop N | cluster-start N | cluster-kill N
#                                     one node (1-3) of the cluster: a clean
#                                     shutdown, a start (it rejoins), kill -9
#   scripts/rabbitmq.sh cluster-pause N SECONDS
#                                     freeze a node's Erlang VM (SIGSTOP) for
#                                     SECONDS, then resume it (SIGCONT)
#
# RABBITMQ picks the broker:
#   4.3 (default)  RabbitMQ 4.3 from Debian's unstable suite (sid), installed
#                  with debootstrap into its own root, $RABBITMQ_ROOT
#                  (/var/tmp/delayd-rabbitmq-4.3: built once per machine, about
#                  a minute), run there with chroot: node delayd@localhost,
#                  AMQP 127.0.0.1:5672, distribution port 25680. The host's
#                  apt sources are left alone.
#   3.10           Debian 12's own rabbitmq-server, installed on the host with
#                  apt (the oldest version delayd claims): 127.0.0.1:5672.
#   cluster        three 4.3 nodes of the same root joined in one cluster,
#                  beside the single node: delayd-c1@localhost,
#                  delayd-c2@localhost, delayd-c3@localhost on AMQP ports
#                  5681, 5682, 5683 (distribution ports 25681-25683).
#   tls            one more 4.3 node of the same root, beside the single
#                  node: delayd-tls@localhost with a TLS listener only,
#                  amqps://127.0.0.1:5671 (distribution port 25679), certificates
#                  from scripts/tls.sh, verify_peer + fail_if_no_peer_cert
#                  (every client shows a certificate of the test CA), PLAIN and
#                  EXTERNAL logins (rabbitmq_auth_mechanism_ssl, the user is the
#                  certificate's CN), user "delayd" with the password in
#                  $(scripts/tls.sh dir)/rabbitmq-password.
#
# For a 4.3 root, `rabbitmqctl`, `rabbitmq-plugins`, `rabbitmq-diagnostics`,
# `rabbitmq-queues`, `rabbitmq-streams` and `rabbitmq-upgrade` in
# /usr/local/sbin run the root's command against the root's nodes: the single
# node by default, a cluster node with `-n delayd-c2@localhost`.
# The broker settings delayd expects are in scripts/rabbitmq/delayd.conf.
#
# Other knobs: RABBITMQ_ROOT, RABBITMQ_SUITE (sid), RABBITMQ_MIRROR
# (http://deb.debian.org/debian), RABBITMQ_START_TIMEOUT (seconds, 180),
# RABBITMQ_ANY_VERSION=1 (reuse a broker on the port whatever its version).
set -euo pipefail

CMD=${1:-start}
MODE=${RABBITMQ:-4.3}
ROOT=${RABBITMQ_ROOT:-/var/tmp/delayd-rabbitmq-4.3}
SUITE=${RABBITMQ_SUITE:-sid}
MIRROR=${RABBITMQ_MIRROR:-http://deb.debian.org/debian}
START_TIMEOUT=${RABBITMQ_START_TIMEOUT:-180}
WRAPPER_DIR=/usr/local/sbin
WRAPPED="rabbitmqctl rabbitmq-plugins rabbitmq-diagnostics rabbitmq-queues rabbitmq-streams rabbitmq-upgrade"
WRAPPER_MARK="delayd-rabbitmq-wrapper"
PLUGINS="rabbitmq_consistent_hash_exchange rabbitmq_auth_mechanism_ssl"
# The single node also speaks the native stream protocol, on 127.0.0.1:5552
# (scripts/bench-stream-native.sh); the other nodes share one plugin file.
HERE=$(cd "$(dirname "$0")" && pwd)
CONF_BASE="$HERE/rabbitmq/delayd.conf"

say() { echo "rabbitmq: $*"; }
warn() { echo "rabbitmq: $*" >&2; }
die() {
    echo "rabbitmq: error: $*" >&2
    exit 1
}

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# The version the AMQP server on a port announces (its connection.start), or
# nothing. The version is a table entry: "version", 'S', a 4-byte length, the text.
amqp_version() {
    timeout 5 bash -c 'exec 3<>"/dev/tcp/127.0.0.1/$0" &&
        printf "AMQP\0\0\011\001" >&3 && dd bs=8192 count=1 status=none <&3' "$1" 2>/dev/null |
        tr -c '[:print:]' '\n' | grep -v '^$' | grep -A1 -x 'versionS' | sed -n 2p || true
}

need_root() {
    [ "$(id -u)" -eq 0 ] && return 0
    command -v sudo >/dev/null || die "this needs root (chroot, mount, apt); run it as root"
    exec sudo -E bash "$0" "$@"
}

# One run at a time per machine (a test run and a quick start may race).
# The lock fd is closed for the brokers started here.
take_lock() {
    exec 9>/var/tmp/delayd-rabbitmq.lock
    flock -w 900 9 || die "another scripts/rabbitmq.sh held /var/tmp/delayd-rabbitmq.lock for 15 minutes"
}

# ---------------------------------------------------------------- the 4.3 root

# Node "" is the single node; 1, 2, 3 are the cluster's; t is the TLS node.
node_name() { case "$1" in "") echo delayd@localhost ;; t) echo delayd-tls@localhost ;; *) echo "delayd-c$1@localhost" ;; esac; }
node_port() { case "$1" in "") echo 5672 ;; t) echo 5671 ;; *) echo $((5680 + $1)) ;; esac; }
node_dist_port() { case "$1" in "") echo 25680 ;; t) echo 25679 ;; *) echo $((25680 + $1)) ;; esac; }
node_etc() { case "$1" in "") echo /etc/rabbitmq ;; t) echo /etc/rabbitmq/tls-node ;; *) echo "/etc/rabbitmq/cluster-$1" ;; esac; }
node_data() { case "$1" in "") echo /var/lib/rabbitmq/mnesia ;; t) echo /var/lib/rabbitmq/tls-node ;; *) echo "/var/lib/rabbitmq/cluster-$1" ;; esac; }
node_logs() { case "$1" in "") echo /var/log/rabbitmq ;; t) echo /var/log/rabbitmq/tls-node ;; *) echo "/var/log/rabbitmq/cluster-$1" ;; esac; }
node_label() { case "$1" in "") echo "node $(node_name "$1")" ;; t) echo "TLS node $(node_name "$1")" ;; *) echo "cluster node $1 ($(node_name "$1"))" ;; esac; }
# Streams replicate over ports of their own: one range per node.
node_stream_min() { case "$1" in "") echo 6000 ;; t) echo 6900 ;; *) echo $((6000 + $1 * 100)) ;; esac; }

# A command of the root, as its rabbitmq user, for node $1 (given up after
# CTL_TIMEOUT seconds).
in_root() {
    local node=$1
    shift
    timeout "${CTL_TIMEOUT:-300}" chroot --userspec=rabbitmq:rabbitmq "$ROOT" /usr/bin/env -i \
        HOME=/var/lib/rabbitmq PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 LC_ALL=C.UTF-8 \
        RABBITMQ_CONF_ENV_FILE="$(node_etc "$node")/rabbitmq-env.conf" "$@" 9>&-
}
ctl() {
    local node=$1
    shift
    in_root "$node" /usr/lib/rabbitmq/bin/rabbitmqctl -n "$(node_name "$node")" "$@"
}

root_ready() { [ -f "$ROOT/.delayd-root-ready" ]; }

# Mount points at or under a directory, deepest first.
mounts_under() {
    findmnt -rn -o TARGET | awk -v d="$1" '$0 == d || index($0, d "/") == 1' | sort -r
}

# Removes a tree that may hold mounts (a debootstrap that was interrupted
# leaves its /proc and /sys mounted): unmount first, never cross into another
# file system.
remove_tree() {
    local dir=$1 m
    [ -e "$dir" ] || return 0
    for m in $(mounts_under "$dir"); do umount "$m" 2>/dev/null || umount -l "$m"; done
    [ -z "$(mounts_under "$dir")" ] || die "cannot unmount everything under $dir: $(mounts_under "$dir" | tr '\n' ' ')"
    rm -rf --one-file-system "$dir"
}

build_root() {
    root_ready && return 0
    if [ -e "$ROOT" ]; then
        die "$ROOT exists but is not a finished root (no .delayd-root-ready): remove it (unmount $ROOT/proc and $ROOT/dev first) or set RABBITMQ_ROOT"
    fi
    if ! command -v debootstrap >/dev/null; then
        say "installing debootstrap with apt"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq debootstrap >/dev/null 2>&1 ||
            { apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; } ||
            die "cannot install debootstrap with apt"
    fi
    local partial="$ROOT.partial" log="$ROOT.debootstrap.log" t0=$SECONDS
    remove_tree "$partial"
    mkdir -p "$(dirname "$ROOT")"
    say "building $ROOT: debootstrap --variant=minbase --include=rabbitmq-server $SUITE from $MIRROR (once per machine, about a minute; log in $log)"
    if ! debootstrap --variant=minbase --include=rabbitmq-server "$SUITE" "$partial" "$MIRROR" >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        remove_tree "$partial"
        die "debootstrap failed (log: $log). If $SUITE's rabbitmq-server cannot be installed today, RABBITMQ_SUITE=trixie gives RabbitMQ 4.0"
    fi
    [ -x "$partial/usr/lib/rabbitmq/bin/rabbitmq-server" ] || die "debootstrap finished but $partial has no rabbitmq-server"
    rm -f "$partial"/var/cache/apt/archives/*.deb
    touch "$partial/.delayd-root-ready"
    mv "$partial" "$ROOT"
    say "root built in $((SECONDS - t0)) s: rabbitmq-server $(root_version)"
}

root_version() { chroot "$ROOT" dpkg-query -W -f '${Version}' rabbitmq-server 2>/dev/null | cut -d- -f1; }

plugin_shipped() { compgen -G "$ROOT/usr/lib/rabbitmq/lib/rabbitmq_server-*/plugins/$1-*" >/dev/null; }

node_plugins_file() { case "$1" in "") echo /etc/rabbitmq/enabled_plugins.single ;; *) echo /etc/rabbitmq/enabled_plugins ;; esac; }

# The plugin file $1 (in the root) enabling plugins $2...
write_plugins() {
    local path=$1 IFS=,
    shift
    echo "[$*]." | put "$ROOT$path"
    # rabbitmq-plugins enable/disable (through the wrapper) runs as rabbitmq.
    chroot "$ROOT" chown rabbitmq:rabbitmq "$path"
}

# Writes a file only when its content changes (so reruns touch nothing).
put() {
    local path=$1 tmp
    tmp=$(mktemp)
    cat >"$tmp"
    if cmp -s "$tmp" "$path" 2>/dev/null; then
        rm -f "$tmp"
    else
        mkdir -p "$(dirname "$path")"
        mv "$tmp" "$path"
        chmod 644 "$path"
    fi
}

# The node's environment (rabbitmq-env.conf), config, data and log directories.
configure_node() {
    local node=$1 etc data logs
    etc=$(node_etc "$node")
    data=$(node_data "$node")
    logs=$(node_logs "$node")
    put "$ROOT$etc/rabbitmq-env.conf" <<EOF
# Written by delayd's scripts/rabbitmq.sh: $(node_label "$node").
NODENAME=$(node_name "$node")
NODE_IP_ADDRESS=127.0.0.1
NODE_PORT=$(node_port "$node")
DIST_PORT=$(node_dist_port "$node")
CONFIG_FILE=$etc/rabbitmq.conf
ENABLED_PLUGINS_FILE=$(node_plugins_file "$node")
MNESIA_BASE=$data
LOG_BASE=$logs
# CLI tools: a wider port range than the default 11 (tests run several at once).
CTL_DIST_PORT_MIN=35700
CTL_DIST_PORT_MAX=35799
# Schedulers unbound: several nodes share the machine's cores with builds.
SCHEDULER_BIND_TYPE=u
# Erlang distribution and epmd on loopback too.
ERL_EPMD_ADDRESS=127.0.0.1
SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
EOF
    local stream_min
    stream_min=$(node_stream_min "$node")
    [ "$node" != t ] || install_tls_files
    {
        cat "$CONF_BASE"
        echo
        echo "# The test broker: $(node_label "$node"), written by scripts/rabbitmq.sh."
        echo "# guest/guest from loopback only (RabbitMQ's default, said out loud)."
        echo "loopback_users.guest = true"
        if [ "$node" = t ]; then
            tls_listener_conf
        else
            echo "listeners.tcp.default = 127.0.0.1:$(node_port "$node")"
        fi
        if [ -z "$node" ]; then
            echo "# The native stream protocol (rabbitmq_stream), this node only."
            echo "stream.listeners.tcp.default = 127.0.0.1:5552"
            echo "stream.advertised_host = 127.0.0.1"
        fi
        echo "# The log goes to the node's log file only (its stdout is a second copy)."
        echo "log.console = false"
        echo "# Streams replicate over ports of their own: one range per node."
        echo "stream.replication.port_range.min = $stream_min"
        echo "stream.replication.port_range.max = $((stream_min + 99))"
        case "$node" in
        "") ;;
        t) echo "cluster_name = delayd-tls" ;;
        *) echo "cluster_name = delayd-test" ;;
        esac
    } | put "$ROOT$etc/rabbitmq.conf"
    chroot "$ROOT" install -d -o rabbitmq -g rabbitmq "$data" "$logs"
}

# ---------------------------------------------------------------- the TLS node

TLS_ETC=/etc/rabbitmq/tls-node/certs

# The test CA and the server's certificate and key (scripts/tls.sh), copied
# into the root for the node's rabbitmq user.
install_tls_files() {
    local src f
    src=$(bash "$HERE/tls.sh" dir)
    bash "$HERE/tls.sh" >&2
    mkdir -p "$ROOT$TLS_ETC"
    for f in ca.crt server.crt server.key; do
        put "$ROOT$TLS_ETC/$f" <"$src/$f"
    done
    chroot "$ROOT" chown -R rabbitmq:rabbitmq "$TLS_ETC"
    chmod 600 "$ROOT$TLS_ETC/server.key"
}

# A TLS listener only: every client must show a certificate signed by the
# test CA; it then logs in with a password (PLAIN) or as the certificate's
# CN (EXTERNAL, rabbitmq_auth_mechanism_ssl).
tls_listener_conf() {
    cat <<EOF
listeners.tcp = none
listeners.ssl.default = 127.0.0.1:$(node_port t)
ssl_options.cacertfile = $TLS_ETC/ca.crt
ssl_options.certfile = $TLS_ETC/server.crt
ssl_options.keyfile = $TLS_ETC/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = true
auth_mechanisms.1 = PLAIN
auth_mechanisms.2 = AMQPLAIN
auth_mechanisms.3 = EXTERNAL
ssl_cert_login_from = common_name
EOF
}

# User "delayd" (password from scripts/tls.sh; EXTERNAL logs in as it too)
# with every permission on vhost /.
tls_users() {
    local password
    password=$(cat "$(bash "$HERE/tls.sh" dir)/rabbitmq-password")
    if ! ctl t -q list_users 2>/dev/null | awk '{print $1}' | grep -qx delayd; then
        ctl t -q add_user delayd "$password" >/dev/null
    else
        ctl t -q change_password delayd "$password" >/dev/null
    fi
    ctl t -q set_permissions -p / delayd '.*' '.*' '.*' >/dev/null
}

tls_start() {
    if port_open "$(node_port t)" && root_ready && [ -n "$(node_pid t)" ]; then
        say "TLS node already up on 127.0.0.1:$(node_port t) (amqps)"
        return 0
    fi
    need_root "$@"
    take_lock
    prepare_root t
    start_node_nowait t
    wait_node t
    tls_users
    say "TLS node up: amqps://127.0.0.1:$(node_port t) (CA, certificates and passwords in $(bash "$HERE/tls.sh" dir))"
}

configure_root() {
    cp /etc/hosts "$ROOT/etc/hosts"
    local p enabled=()
    for p in $PLUGINS; do
        if plugin_shipped "$p"; then enabled+=("$p"); else warn "plugin $p does not ship with rabbitmq-server $(root_version): not enabled"; fi
    done
    write_plugins "$(node_plugins_file 1)" "${enabled[@]}"
    if plugin_shipped rabbitmq_stream; then enabled+=(rabbitmq_stream); fi
    write_plugins "$(node_plugins_file "")" "${enabled[@]}"
    local node
    for node in "$@"; do configure_node "$node"; done
}

# /proc and /dev inside the root (bind-mounted /dev: never rm -rf the root
# while it is mounted; `scripts/rabbitmq.sh stop` unmounts once nothing runs).
mount_root() {
    mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc" || die "cannot mount /proc in $ROOT"
    mountpoint -q "$ROOT/dev" || mount --bind /dev "$ROOT/dev" || die "cannot bind-mount /dev in $ROOT"
}

# A process that runs (not a zombie).
pid_alive() { [ -e "/proc/$1/stat" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }

# Live processes whose root is the broker's root (zombies aside).
root_pids() {
    local p
    for p in /proc/[0-9]*; do
        [ "$(readlink "$p/root" 2>/dev/null)" = "$ROOT" ] || continue
        pid_alive "${p#/proc/}" && echo "${p#/proc/}"
    done
    return 0
}

# The processes of a node: those with the DELAYD_RABBITMQ_NODE its start set
# (its start script, then the Erlang VM that replaces it), but epmd, which
# the first node starts and which outlives it.
node_pids() {
    local want="DELAYD_RABBITMQ_NODE=$(node_name "$1")" p
    for p in $(root_pids); do
        [ "$(cat "/proc/$p/comm" 2>/dev/null)" = epmd ] && continue
        tr '\0' '\n' 2>/dev/null <"/proc/$p/environ" | grep -qx "$want" && echo "$p"
    done
    return 0
}

# The node's Erlang VM.
node_pid() {
    local p
    for p in $(node_pids "$1"); do
        [ "$(cat "/proc/$p/comm" 2>/dev/null)" = beam.smp ] && { echo "$p"; return 0; }
    done
    return 0
}

unmount_if_idle() {
    [ -n "$(root_pids)" ] && return 0
    local m
    for m in "$ROOT/dev" "$ROOT/proc"; do
        if mountpoint -q "$m"; then umount "$m" 2>/dev/null || umount -l "$m"; fi
    done
}

install_wrappers() {
    local cmd path
    for cmd in $WRAPPED; do
        path="$WRAPPER_DIR/$cmd"
        if [ -e "$path" ] && ! grep -q "$WRAPPER_MARK" "$path"; then
            warn "$path exists and is not delayd's wrapper: left alone"
            continue
        fi
        put "$path" <<EOF
#!/bin/sh
# $WRAPPER_MARK: installed by delayd's scripts/rabbitmq.sh. Runs $cmd of the
# RabbitMQ root $ROOT against its nodes: the single
# node delayd@localhost by default, a cluster node with -n delayd-c2@localhost.
[ "\$(id -u)" -eq 0 ] || exec sudo -n "\$0" "\$@"
[ -f "$ROOT/.delayd-root-ready" ] || { echo "$cmd: no RabbitMQ root at $ROOT: run scripts/rabbitmq.sh" >&2; exit 69; }
exec chroot --userspec=rabbitmq:rabbitmq "$ROOT" /usr/bin/env -i \\
    HOME=/var/lib/rabbitmq PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 LC_ALL=C.UTF-8 \\
    /usr/lib/rabbitmq/bin/$cmd "\$@"
EOF
        chmod 755 "$path"
    done
    path=$(command -v rabbitmqctl || true)
    if [ "$path" != "$WRAPPER_DIR/rabbitmqctl" ]; then
        warn "\`rabbitmqctl\` on PATH is ${path:-missing}, not $WRAPPER_DIR/rabbitmqctl: put $WRAPPER_DIR first in PATH"
    fi
}

remove_wrappers() {
    local cmd
    for cmd in $WRAPPED; do
        if [ -f "$WRAPPER_DIR/$cmd" ] && grep -q "$WRAPPER_MARK" "$WRAPPER_DIR/$cmd"; then
            rm -f "$WRAPPER_DIR/$cmd"
        fi
    done
}

node_logs_tail() {
    local node=$1 name
    name=$(node_name "$node")
    warn "--- last lines of $ROOT$(node_logs "$node")/$name.stdout.log:"
    tail -n 15 "$ROOT$(node_logs "$node")/$name.stdout.log" >&2 2>/dev/null || true
    warn "--- last lines of $ROOT$(node_logs "$node")/$name.log:"
    tail -n 25 "$ROOT$(node_logs "$node")/$name.log" >&2 2>/dev/null || true
}

launch_node() {
    local node=$1 name logs
    name=$(node_name "$node")
    logs=$(node_logs "$node")
    say "starting $(node_label "$node") on 127.0.0.1:$(node_port "$node") (RabbitMQ $(root_version))"
    # setsid: the node outlives this script and the terminal; fd 9 is the lock.
    setsid chroot --userspec=rabbitmq:rabbitmq "$ROOT" /usr/bin/env -i \
        HOME=/var/lib/rabbitmq PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 LC_ALL=C.UTF-8 \
        RABBITMQ_CONF_ENV_FILE="$(node_etc "$node")/rabbitmq-env.conf" DELAYD_RABBITMQ_NODE="$name" \
        /usr/lib/rabbitmq/bin/rabbitmq-server \
        >>"$ROOT$logs/$name.stdout.log" 2>&1 </dev/null 9>&- &
}

# Waits until the node's AMQP port is open and the node says it has booted.
wait_node() {
    local node=$1 t0=$SECONDS deadline=$((SECONDS + START_TIMEOUT)) port gone=0
    port=$(node_port "$node")
    while [ "$SECONDS" -lt "$deadline" ]; do
        if port_open "$port" && ctl "$node" -q await_startup --timeout 10 >/dev/null 2>&1; then
            say "$(node_label "$node") up on 127.0.0.1:$port ($((SECONDS - t0)) s)"
            return 0
        fi
        # (A launch takes a moment to chroot: a few misses before giving up.)
        if [ -z "$(node_pids "$node")" ]; then
            gone=$((gone + 1))
            if [ "$gone" -ge 3 ]; then
                node_logs_tail "$node"
                die "$(node_label "$node") exited while starting (logs above)"
            fi
        else
            gone=0
        fi
        sleep 1
    done
    node_logs_tail "$node"
    die "$(node_label "$node") did not start within $START_TIMEOUT s (RABBITMQ_START_TIMEOUT; logs above)"
}

# Starts a node unless it runs: a node whose app was stopped (stop_app) is
# started again, a node still booting is waited for.
start_node_nowait() {
    local node=$1
    port_open "$(node_port "$node")" && return 0
    if [ -n "$(node_pids "$node")" ]; then
        if ! ctl "$node" -q await_startup --timeout 10 >/dev/null 2>&1; then
            say "$(node_label "$node") runs but its app is stopped: start_app"
            ctl "$node" -q start_app >/dev/null 2>&1 || true
        fi
        return 0
    fi
    launch_node "$node"
}

stop_node() {
    local node=$1 pid
    pid=$(node_pid "$node")
    if [ -z "$pid" ]; then
        say "$(node_label "$node") is not running"
        return 0
    fi
    say "stopping $(node_label "$node")"
    local i
    if ! CTL_TIMEOUT=120 ctl "$node" -q shutdown >/dev/null 2>&1; then
        warn "rabbitmqctl shutdown failed: SIGTERM to pid $pid"
        kill -TERM "$pid" 2>/dev/null || true
        for i in $(seq 1 300); do pid_alive "$pid" || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    for i in $(seq 1 100); do pid_alive "$pid" || break; sleep 0.1; done
    pid_alive "$pid" && die "$(node_label "$node") (pid $pid) still runs"
    say "$(node_label "$node") stopped"
}

kill_node() {
    local node=$1 pid i
    pid=$(node_pid "$node")
    [ -n "$pid" ] || die "$(node_label "$node") is not running"
    say "kill -9 $(node_label "$node") (pid $pid)"
    kill -KILL "$pid"
    for i in $(seq 1 100); do pid_alive "$pid" || return 0; sleep 0.1; done
    die "pid $pid still there 10 s after kill -9"
}

stop_epmd_if_idle() {
    # epmd (started by the first node) refuses to die while nodes are registered.
    local pids
    pids=$(for p in $(root_pids); do [ "$(cat "/proc/$p/comm" 2>/dev/null)" != beam.smp ] || echo "$p"; done)
    [ -z "$pids" ] || return 0
    in_root "" /usr/bin/epmd -kill >/dev/null 2>&1 || true
    sleep 0.2
}

# Makes sure the root exists and is configured for the given nodes.
prepare_root() {
    build_root
    configure_root "$@"
    mount_root
    install_wrappers
}

check_reuse() {
    # A broker already on the port: reuse it if its version is the one asked for.
    local port=$1 want=$2 version
    version=$(amqp_version "$port")
    if [ -z "$version" ]; then
        die "something listens on 127.0.0.1:$port but does not answer as an AMQP broker"
    fi
    case "$version" in
    "$want"*) ;;
    *)
        if [ "${RABBITMQ_ANY_VERSION:-0}" = 1 ]; then
            warn "RabbitMQ $version on 127.0.0.1:$port, RABBITMQ=$MODE asked for ${want}x: reused (RABBITMQ_ANY_VERSION=1)"
        else
            die "RabbitMQ $version already listens on 127.0.0.1:$port but RABBITMQ=$MODE asks for ${want}x. Stop it first (RABBITMQ=<its mode> scripts/rabbitmq.sh stop), or reuse it anyway with RABBITMQ_ANY_VERSION=1"
        fi
        ;;
    esac
    echo "$version"
}

single_start() {
    local version
    if port_open 5672; then
        version=$(check_reuse 5672 4.)
        if root_ready && [ -n "$(node_pid "")" ]; then
            # Ours: make sure the wrappers are there (cheap, idempotent).
            if [ "$(id -u)" -eq 0 ]; then
                install_wrappers
                # A node started before scripts/rabbitmq/delayd.conf changed
                # runs with the old settings: the tests expect the new ones.
                take_lock
                local conf before
                conf="$ROOT$(node_etc "")/rabbitmq.conf"
                before=$(cksum "$conf" 2>/dev/null || true)
                configure_root ""
                if [ "$(cksum "$conf")" != "$before" ]; then
                    say "its configuration changed (scripts/rabbitmq/delayd.conf): restarting it"
                    stop_node ""
                    start_node_nowait ""
                    wait_node ""
                    return 0
                fi
            fi
            say "already listening on 127.0.0.1:5672 (RabbitMQ $version, node delayd@localhost in $ROOT)"
        else
            say "already listening on 127.0.0.1:5672 (RabbitMQ $version, not the node of $ROOT: \`rabbitmqctl\` must reach it by itself)"
        fi
        return 0
    fi
    need_root "$@"
    take_lock
    port_open 5672 && { say "already listening on 127.0.0.1:5672 (started meanwhile)"; return 0; }
    prepare_root ""
    case "$(root_version)" in 4.3.*) ;; *) warn "the root has rabbitmq-server $(root_version), not 4.3.x ($SUITE moved on)" ;; esac
    start_node_nowait ""
    wait_node ""
}

cluster_members() {
    # The disk nodes of the cluster node $1 belongs to, one per line.
    ctl "$1" -q cluster_status --formatter json 2>/dev/null |
        grep -o '"disk_nodes":\[[^]]*\]' | grep -o 'delayd[^"]*@[^"]*' || true
}

cluster_start() {
    local n all_open=1
    for n in 1 2 3; do port_open "$(node_port "$n")" || all_open=0; done
    if [ "$all_open" = 1 ] && root_ready && [ "$(cluster_members 1 | sort | tr '\n' ' ')" = "$(node_name 1) $(node_name 2) $(node_name 3) " ]; then
        say "cluster delayd-test already up on 127.0.0.1:5681, 5682, 5683 (RabbitMQ $(amqp_version 5681))"
        return 0
    fi
    need_root "$@"
    take_lock
    prepare_root 1 2 3
    if [ "$all_open" = 0 ]; then
        # All at once: after a full stop each node waits for the others
        # (the metadata store, Khepri, needs a majority).
        for n in 1 2 3; do start_node_nowait "$n"; done
    fi
    for n in 1 2 3; do wait_node "$n"; done
    for n in 2 3; do
        if ! cluster_members 1 | grep -qx "$(node_name "$n")"; then
            say "joining $(node_name "$n") to $(node_name 1)"
            ctl "$n" -q stop_app >/dev/null
            ctl "$n" -q reset >/dev/null
            ctl "$n" -q join_cluster "$(node_name 1)" >/dev/null
            ctl "$n" -q start_app >/dev/null
            wait_node "$n"
        fi
    done
    ctl 1 -q await_online_nodes 3 --timeout 60 >/dev/null 2>&1 ||
        die "the cluster does not show 3 running nodes: $(ctl 1 -q cluster_status 2>&1 | tr '\n' ' ')"
    say "cluster delayd-test up: $(cluster_members 1 | tr '\n' ' ')on 127.0.0.1:5681, 5682, 5683 (RabbitMQ $(root_version))"
}

cluster_node_arg() {
    case "${1:-}" in
    1 | 2 | 3) echo "$1" ;;
    *) die "a cluster node is 1, 2 or 3, not '${1:-}'" ;;
    esac
}

# ---------------------------------------------------------------- 3.10 on the host

host_start() {
    if port_open 5672; then
        local version
        version=$(check_reuse 5672 3.)
        [ "$(id -u)" -eq 0 ] && remove_wrappers
        say "already listening on 127.0.0.1:5672 (RabbitMQ $version)"
        return 0
    fi
    need_root "$@"
    take_lock
    remove_wrappers
    if [ ! -x /usr/sbin/rabbitmq-server ]; then
        say "installing rabbitmq-server (Debian 12) with apt"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq rabbitmq-server >/dev/null
    fi
    say "starting the host's rabbitmq-server"
    /usr/sbin/rabbitmq-server -detached 9>&- || true
    local deadline=$((SECONDS + START_TIMEOUT))
    while [ "$SECONDS" -lt "$deadline" ]; do
        if port_open 5672; then
            /usr/sbin/rabbitmqctl await_startup >/dev/null 2>&1 || true
            say "up: RabbitMQ $(amqp_version 5672) on 127.0.0.1:5672"
            return 0
        fi
        sleep 1
    done
    tail -n 20 /var/log/rabbitmq/*.log >&2 2>/dev/null || true
    die "the host's rabbitmq-server did not start within $START_TIMEOUT s"
}

host_stop() {
    need_root "$@"
    if [ -x /usr/sbin/rabbitmqctl ] && port_open 5672; then
        say "stopping the host's rabbitmq-server"
        /usr/sbin/rabbitmqctl -q shutdown >/dev/null 2>&1 || /usr/sbin/rabbitmqctl -q stop >/dev/null
        # Its epmd too (it refuses while other nodes are registered).
        epmd -kill >/dev/null 2>&1 || true
    else
        say "the host's rabbitmq-server is not running"
    fi
}

# ---------------------------------------------------------------- status

status() {
    local node v
    if v=$(port_open 5672 && amqp_version 5672) && [ -n "$v" ]; then
        echo "127.0.0.1:5672  RabbitMQ $v"
    else
        echo "127.0.0.1:5672  nothing listening"
    fi
    if root_ready; then
        echo "root $ROOT: rabbitmq-server $(root_version)"
        for node in "" 1 2 3 t; do
            [ -d "$ROOT$(node_etc "$node")" ] || continue
            printf '  %-40s port %s  ' "$(node_label "$node")" "$(node_port "$node")"
            if [ -n "$(node_pid "$node")" ]; then
                if port_open "$(node_port "$node")"; then echo "running (pid $(node_pid "$node"))"; else echo "process up, port closed (booting or app stopped)"; fi
            else
                echo "stopped"
            fi
        done
    else
        echo "root $ROOT: not built"
    fi
    echo "rabbitmqctl: $(command -v rabbitmqctl || echo none)"
}

# ---------------------------------------------------------------- main

case "$MODE:$CMD" in
4.3:start) single_start "$@" ;;
tls:start) tls_start "$@" ;;
tls:stop)
    need_root "$@"
    take_lock
    if root_ready; then
        stop_node t
        stop_epmd_if_idle
        unmount_if_idle
    fi
    ;;
3.10:start) host_start "$@" ;;
cluster:start) cluster_start "$@" ;;
4.3:stop)
    need_root "$@"
    take_lock
    if root_ready; then
        stop_node ""
        stop_epmd_if_idle
        unmount_if_idle
    else
        say "no root at $ROOT: nothing to stop"
    fi
    ;;
cluster:stop)
    need_root "$@"
    take_lock
    if root_ready; then
        for n in 3 2 1; do stop_node "$n"; done
        stop_epmd_if_idle
        unmount_if_idle
    fi
    ;;
3.10:stop) host_stop "$@" ;;
*:restart)
    RABBITMQ=$MODE bash "$0" stop
    RABBITMQ=$MODE bash "$0" start
    ;;
*:status) status ;;
*:cluster-stop | *:cluster-start | *:cluster-kill | *:cluster-pause)
    need_root "$@"
    n=$(cluster_node_arg "${2:-}")
    take_lock
    root_ready || die "no root at $ROOT: start the cluster first (RABBITMQ=cluster scripts/rabbitmq.sh)"
    case "$CMD" in
    cluster-stop) stop_node "$n" ;;
    cluster-kill) kill_node "$n" ;;
    cluster-pause)
        pid=$(node_pid "$n")
        [ -n "$pid" ] || die "$(node_label "$n") is not running"
        kill -STOP "$pid"
        sleep "${3:?cluster-pause N SECONDS}"
        kill -CONT "$pid"
        ;;
    cluster-start)
        configure_root "$n"
        mount_root
        start_node_nowait "$n"
        wait_node "$n"
        ;;
    esac
    ;;
*:start | *:stop) die "RABBITMQ is 4.3, 3.10, cluster or tls, not '$MODE'" ;;
*) usage ;;
esac

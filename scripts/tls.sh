#!/usr/bin/env bash
# The test certificates and secrets: a private CA, a server certificate for
# localhost / 127.0.0.1, a client certificate (CN=delayd), a second CA that
# signed nothing delayd is shown (the "wrong CA"), and the passwords of the
# test users. Generated with openssl on first use and kept in $DELAYD_TLS_DIR
# (/var/tmp/delayd-tls); nothing here is committed.
#
#   scripts/tls.sh          make them unless they exist (and are valid for a day more)
#   scripts/tls.sh dir      print the directory
#
# Files:
#   ca.crt ca.key                 the test CA
#   server.crt server.key         CN=localhost, SAN DNS:localhost, IP:127.0.0.1
#   server-kafka.pem              server key + certificate (Kafka PEM keystore)
#   client.crt client.key         CN=delayd, clientAuth (RabbitMQ EXTERNAL user "delayd")
#   other-ca.crt                  a CA nobody uses
#   rabbitmq-password             password of RabbitMQ user "delayd" on the TLS node
#   kafka-password                SCRAM-SHA-512 password of Kafka user "delayd"
#
# Used by scripts/rabbitmq.sh (RABBITMQ=tls) and scripts/kafka.sh, which copy
# or point at these files, and by the tests (DELAYD_TLS_DIR overrides).
set -euo pipefail
dir="${DELAYD_TLS_DIR:-/var/tmp/delayd-tls}"
days=3650

say() { echo "tls: $*"; }

if [ "${1:-}" = dir ]; then
    echo "$dir"
    exit 0
fi

complete() {
    local f
    for f in ca.crt ca.key server.crt server.key server-kafka.pem client.crt client.key \
        other-ca.crt rabbitmq-password kafka-password; do
        [ -s "$dir/$f" ] || return 1
    done
    openssl x509 -checkend 86400 -noout -in "$dir/server.crt" >/dev/null 2>&1 &&
        openssl x509 -checkend 86400 -noout -in "$dir/client.crt" >/dev/null 2>&1
}

# One maker at a time (the broker scripts may run together).
mkdir -p "$(dirname "$dir")"
exec 8>"$dir.lock"
flock -w 120 8

if complete; then
    exit 0
fi

command -v openssl >/dev/null || {
    say "installing openssl with apt"
    export DEBIAN_FRONTEND=noninteractive
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO=sudo
    $SUDO apt-get install -y -qq openssl >/dev/null 2>&1 ||
        { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq openssl >/dev/null; }
}

say "generating the test CA, certificates and passwords in $dir"
tmp="$dir.partial"
rm -rf "$tmp"
mkdir -p "$tmp"
cd "$tmp"

# A CA of its own (basicConstraints CA:TRUE, keyCertSign: what rustls and
# Erlang's ssl check).
ca() { # name subject
    openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days "$days" \
        -keyout "$1.key" -out "$1.crt" -subj "$2" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" \
        -addext "subjectKeyIdentifier=hash" 2>/dev/null
}

leaf() { # name subject extensions-file
    openssl req -newkey rsa:2048 -nodes -sha256 -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
    openssl x509 -req -sha256 -days "$days" -in "$1.csr" -CA ca.crt -CAkey ca.key \
        -set_serial "0x$(openssl rand -hex 16)" -out "$1.crt" -extfile "$3" 2>/dev/null
    rm -f "$1.csr"
}

ca ca "/CN=delayd test CA"
ca other-ca "/CN=delayd wrong CA"
rm -f other-ca.key

cat >server.ext <<'EOF'
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=DNS:localhost,IP:127.0.0.1
EOF
cat >client.ext <<'EOF'
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth
EOF
leaf server "/CN=localhost" server.ext
leaf client "/CN=delayd" client.ext
rm -f server.ext client.ext

# Kafka's PEM keystore: the (PKCS#8, unencrypted) key, then the chain.
cat server.key server.crt >server-kafka.pem

# Random passwords, hex: nothing to escape in a properties file or a URL.
openssl rand -hex 16 >rabbitmq-password
openssl rand -hex 16 >kafka-password

# Readable by the brokers' own users (rabbitmq copies them into its root).
chmod 644 ./*.crt
chmod 640 ./*.key server-kafka.pem rabbitmq-password kafka-password
cd - >/dev/null
rm -rf "$dir"
mv "$tmp" "$dir"
say "done: $(ls "$dir" | tr '\n' ' ')"

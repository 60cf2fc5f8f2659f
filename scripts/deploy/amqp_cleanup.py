#!/usr/bin/env python3
"""Broker set-up and clean-up for scripts/deploy-check.sh (pika).

  amqp_cleanup.py --declare EXCHANGE QUEUE KEY
      a durable topic exchange and a durable queue bound to it with KEY;
  amqp_cleanup.py FILE
      deletes what FILE lists, one per line: `queue NAME`, `exchange NAME`,
      or `prefix NAME` (every queue and stream whose name starts with NAME,
      found with rabbitmqctl: the broker-kept store's state streams and lock).
"""
import subprocess
import sys

import pika

URL = "amqp://guest:guest@127.0.0.1:5672/%2f"


def channel():
    conn = pika.BlockingConnection(pika.URLParameters(URL))
    return conn, conn.channel()


def declare(exchange, queue, key):
    conn, ch = channel()
    ch.exchange_declare(exchange, "topic", durable=True)
    ch.queue_declare(queue, durable=True)
    ch.queue_bind(queue, exchange, key)
    conn.close()


def delete(path):
    with open(path) as f:
        items = [line.split(None, 1) for line in f.read().splitlines() if line.strip()]
    queues = [name for kind, name in items if kind == "queue"]
    exchanges = [name for kind, name in items if kind == "exchange"]
    prefixes = [name for kind, name in items if kind == "prefix"]
    if prefixes:
        out = subprocess.run(
            ["rabbitmqctl", "list_queues", "name", "-q", "--no-table-headers"],
            capture_output=True, text=True, check=False,
        ).stdout
        queues += [q.strip() for q in out.splitlines() if any(q.strip().startswith(p) for p in prefixes)]
    for name in queues:
        conn, ch = channel()
        try:
            ch.queue_delete(name)
        except pika.exceptions.ChannelClosedByBroker:
            pass
        conn.close()
    for name in exchanges:
        conn, ch = channel()
        try:
            ch.exchange_delete(name)
        except pika.exceptions.ChannelClosedByBroker:
            pass
        conn.close()


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--declare":
        declare(*sys.argv[2:])
    elif len(sys.argv) == 2:
        delete(sys.argv[1])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()

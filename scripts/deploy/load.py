#!/usr/bin/env python3
"""Load for the deployment checks: publish delayed messages to delayd's
ingress exchanges over AMQP (pika) and check them at the target queue.

- `--count` messages at `--rate`/s to --exchange with x-delay drawn from
  [--delay-min, --delay-max] ms and routing key ok.N; each must arrive at
  --target-queue once, never early (by its x-delay from its publish, less a
  little clock slack), within --drain seconds after the last one's due time;
- `--invalid` messages with an unusable x-delay ("soon"): delayd sends them
  to the route's invalid destination;
- `--unroutable` messages with routing key nobody.N, which no queue binds:
  they go to the unroutable destination when due;
- `--long` messages to --long-exchange, due in 10 minutes to a week: they
  stay pending.

Prints a JSON summary; exits 1 if a message is lost, early, duplicated
(unless --allow-duplicates) or later than --max-late-ms.
"""
import argparse
import json
import random
import sys
import threading
import time

import pika

SLACK_MS = 5  # the broker's clock (timestamp_in_ms) and ours may differ slightly


def connect(url):
    return pika.BlockingConnection(pika.URLParameters(url))


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/%2f")
    a.add_argument("--exchange", required=True)
    a.add_argument("--target-queue", required=True)
    a.add_argument("--count", type=int, default=1000)
    a.add_argument("--rate", type=float, default=100)
    a.add_argument("--delay-min", type=int, default=1000)
    a.add_argument("--delay-max", type=int, default=3000)
    a.add_argument("--invalid", type=int, default=0)
    a.add_argument("--unroutable", type=int, default=0)
    a.add_argument("--long", type=int, default=0)
    a.add_argument("--long-exchange")
    a.add_argument("--drain", type=float, default=20)
    a.add_argument("--max-late-ms", type=int, help="fail if a message arrives later than this")
    a.add_argument("--allow-duplicates", action="store_true",
                   help="report duplicates without failing (at-least-once across a restart)")
    args = a.parse_args()

    sent = {}  # message_id -> (publish ms, delay ms)
    arrived = {}  # message_id -> [arrival ms, ...]
    lock = threading.Lock()
    stop = threading.Event()
    ready = threading.Event()

    def consume():
        conn = connect(args.url)
        ch = conn.channel()
        ch.basic_qos(prefetch_count=500)
        ready.set()
        while not stop.is_set():
            for method, props, _body in ch.consume(args.target_queue, inactivity_timeout=0.2):
                if method is None:
                    break
                now = int(time.time() * 1000)
                with lock:
                    arrived.setdefault(props.message_id, []).append(now)
                ch.basic_ack(method.delivery_tag)
                if stop.is_set():
                    break
        ch.cancel()
        conn.close()

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    ready.wait(10)

    conn = connect(args.url)
    ch = conn.channel()
    ch.confirm_delivery()

    def publish(exchange, key, mid, delay):
        headers = {"x-delay": delay}
        props = pika.BasicProperties(message_id=mid, headers=headers, delivery_mode=2)
        ch.basic_publish(exchange, key, b'{"order": "%s"}' % mid.encode(), props)

    for i in range(args.invalid):
        publish(args.exchange, f"ok.invalid.{i}", f"invalid-{i}", "soon")
    for i in range(args.unroutable):
        publish(args.exchange, f"nobody.{i}", f"unroutable-{i}", 500)
    for i in range(args.long):
        # Spread over an hour, a day and a week (none within 10 minutes: they
        # must stay pending while the checks run).
        delay = [600_000 + i * 20_000, 7_200_000 + i * 600_000, 172_800_000 + i * 3_600_000][i % 3]
        publish(args.long_exchange, f"later.{i}", f"later-{i}", delay)
    start = time.time()
    last_due = 0
    for i in range(args.count):
        at = start + i / args.rate
        pause = at - time.time()
        if pause > 0:
            time.sleep(pause)
        delay = random.randint(args.delay_min, args.delay_max)
        mid = f"m-{i}"
        t = int(time.time() * 1000)
        publish(args.exchange, f"ok.{i % 7}", mid, delay)
        sent[mid] = (t, delay)
        last_due = max(last_due, t + delay)
    conn.close()

    deadline = last_due / 1000 + args.drain
    while time.time() < deadline:
        with lock:
            if len(arrived) >= len(sent):
                break
        time.sleep(0.2)
    time.sleep(0.5)  # duplicates, if any, arrive close behind
    stop.set()
    consumer.join(10)

    lost = [m for m in sent if m not in arrived]
    duplicated = [m for m, t in arrived.items() if len(t) > 1]
    early = [m for m, t in arrived.items() if m in sent and t[0] < sum(sent[m]) - SLACK_MS]
    late = sorted(t[0] - sum(sent[m]) for m, t in arrived.items() if m in sent)
    summary = {
        "published": len(sent),
        "arrived": len(arrived),
        "lost": len(lost),
        "duplicated": len(duplicated),
        "early": len(early),
        "lateness_ms_p50": late[len(late) // 2] if late else None,
        "lateness_ms_max": late[-1] if late else None,
        "invalid": args.invalid,
        "unroutable": args.unroutable,
        "long": args.long,
    }
    print(json.dumps(summary))
    too_late = args.max_late_ms is not None and late and late[-1] > args.max_late_ms
    if lost or early or (duplicated and not args.allow_duplicates) or too_late:
        print(f"lost {lost[:5]} duplicated {duplicated[:5]} early {early[:5]} "
              f"max lateness {late[-1] if late else None} ms", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

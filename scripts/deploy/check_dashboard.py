#!/usr/bin/env python3
"""Run every query of the Grafana dashboard against a real Prometheus.

Each panel target's expression (with $job/$instance as ".+" and
$__rate_interval as the given window) must return data, and every metric it
names must be in delayd's own /metrics output: a query naming a metric
delayd does not export fails, even where it would return data through
another part of the expression. The template variables' queries are run too.

usage: check_dashboard.py PROMETHEUS_URL DASHBOARD.json METRICS_TEXT RATE_WINDOW
"""
import json
import re
import sys
import urllib.parse
import urllib.request

NAME = re.compile(r"\b((?:delayd|process)_[a-z0-9_]+)\b")
FUNC_ARGS = re.compile(r"label_values\((.*),\s*[a-z_]+\)\s*$")


def exported(metrics_text):
    names = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            names.add(name)
            if kind == "histogram":
                names.update({name + "_bucket", name + "_sum", name + "_count"})
    return names


def query(prom, expr):
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise SystemExit(f"query failed: {expr}: {body}")
    return body["data"]["result"]


def targets(panels):
    for p in panels:
        yield from targets(p.get("panels", []))
        for t in p.get("targets", []):
            yield p, t


def main():
    if len(sys.argv) != 5:
        raise SystemExit(__doc__)
    prom, dashboard, metrics_file, window = sys.argv[1:]
    with open(dashboard) as f:
        dash = json.load(f)
    with open(metrics_file) as f:
        names = exported(f.read())
    failures = []
    checked = 0

    def check(where, expr):
        nonlocal checked
        checked += 1
        unknown = sorted(set(NAME.findall(expr)) - names)
        if unknown:
            failures.append(f"{where}: names metrics delayd does not export: {unknown}\n    {expr}")
            return
        result = query(prom, expr)
        if not result:
            failures.append(f"{where}: no data\n    {expr}")
        else:
            print(f"ok   {where}: {len(result)} series")

    def substitute(expr):
        return (
            expr.replace("$__rate_interval", window)
            .replace("$job", ".+")
            .replace("$instance", ".+")
        )

    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = FUNC_ARGS.search(var["definition"])
        if not m:
            failures.append(f"variable {var['name']}: unexpected query {var['definition']}")
            continue
        check(f"variable ${var['name']}", substitute(m.group(1)))
    panels = 0
    for panel, target in targets(dash["panels"]):
        panels += 1
        check(f"panel {panel['title']!r} {target['refId']}", substitute(target["expr"]))
    for p in dash["panels"]:
        if p["type"] != "row" and not p.get("targets"):
            failures.append(f"panel {p['title']!r} has no query")
    if failures:
        print("\n".join(failures), file=sys.stderr)
        raise SystemExit(f"{len(failures)} of {checked} dashboard queries failed")
    print(f"dashboard: all {checked} queries return data ({panels} panel targets)")


if __name__ == "__main__":
    main()

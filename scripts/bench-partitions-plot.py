#!/usr/bin/env python3
"""Draw scripts/bench-partitions.sh's results (RESULTS=file.jsonl) as an
SVG: delivered msg/s against the number of delayd instances, one line per
broker, beside perfect scaling from one instance (dashed). Standard
library only.

    python3 scripts/bench-partitions-plot.py results.jsonl out.svg
"""
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
W, H, PAD = 460, 300, 60
COLOURS = {"rabbitmq": "#d9534f", "kafka": "#337ab7"}

series = {}
for r in rows:
    series.setdefault(r["broker"], []).append(r)
for points in series.values():
    points.sort(key=lambda r: r["instances"])

xmax = max(r["instances"] for r in rows)
ymax = max(max(r["delivered"] for r in rows),
           max(p[0]["delivered"] * xmax for p in series.values()))
ymax = (int(ymax / 1000) + 1) * 1000


def px(n):
    return PAD + (n - 1) / max(xmax - 1, 1) * (W - PAD - 30)


def py(v):
    return H - PAD - v / ymax * (H - PAD - 40)


out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
       f'font-family="sans-serif" font-size="12">',
       '<rect width="100%" height="100%" fill="white"/>',
       f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">'
       'Scale-out: delivered msg/s, each instance CPU-capped</text>',
       f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - 20}" y2="{H - PAD}" stroke="black"/>',
       f'<line x1="{PAD}" y1="30" x2="{PAD}" y2="{H - PAD}" stroke="black"/>',
       f'<text x="{W / 2}" y="{H - 15}" text-anchor="middle">delayd instances</text>']
for n in range(1, xmax + 1):
    out.append(f'<text x="{px(n)}" y="{H - PAD + 16}" text-anchor="middle">{n}</text>')
for v in range(0, ymax + 1, 1000):
    out.append(f'<text x="{PAD - 6}" y="{py(v) + 4}" text-anchor="end">{v}</text>')
    out.append(f'<line x1="{PAD}" y1="{py(v)}" x2="{W - 20}" y2="{py(v)}" stroke="#eee"/>')
legend_y = 45
for broker, points in sorted(series.items()):
    colour = COLOURS.get(broker, "black")
    one = points[0]["delivered"]
    ideal = " ".join(f"{px(n)},{py(one * n)}" for n in range(1, xmax + 1))
    out.append(f'<polyline points="{ideal}" fill="none" stroke="{colour}" '
               'stroke-dasharray="4 4" stroke-opacity="0.6"/>')
    line = " ".join(f'{px(r["instances"])},{py(r["delivered"])}' for r in points)
    out.append(f'<polyline points="{line}" fill="none" stroke="{colour}" stroke-width="2"/>')
    for r in points:
        out.append(f'<circle cx="{px(r["instances"])}" cy="{py(r["delivered"])}" r="3" '
                   f'fill="{colour}"/>')
    cpu = points[0].get("cpu", "")
    out.append(f'<text x="{PAD + 10}" y="{legend_y}" fill="{colour}">'
               f'{broker}, {cpu} % of a core each (dashed: linear)</text>')
    legend_y += 16
out.append('</svg>')
open(sys.argv[2], "w").write("\n".join(out) + "\n")

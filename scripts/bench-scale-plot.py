#!/usr/bin/env python3
"""Draw scripts/bench-scale.sh's results as an SVG: delayd's RSS after a
restart, and the restart's time to first fire and to consuming, against
the number of pending messages (log scale). Standard library only.

    python3 scripts/bench-scale-plot.py scale.jsonl out.svg
"""
import json
import math
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
rows = [r for r in rows if r["pending"] > 0]
rows.sort(key=lambda r: r["pending"])
W, H, PAD = 420, 260, 50


def panel(x0, title, series, unit, ymax):
    out = [f'<g transform="translate({x0},0)">',
           f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
           f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - 10}" y2="{H - PAD}" stroke="black"/>',
           f'<line x1="{PAD}" y1="30" x2="{PAD}" y2="{H - PAD}" stroke="black"/>']
    lo = math.log10(min(r["pending"] for r in rows))
    hi = math.log10(max(r["pending"] for r in rows))
    span = max(hi - lo, 1)

    def px(n):
        return PAD + (math.log10(n) - lo) / span * (W - PAD - 30)

    def py(v):
        return H - PAD - v / ymax * (H - PAD - 40)

    for r in rows:
        x = px(r["pending"])
        label = f'{r["pending"] / 1e6:g}M'
        out.append(f'<text x="{x}" y="{H - PAD + 16}" text-anchor="middle" font-size="11">{label}</text>')
    for k in range(5):
        v = ymax * k / 4
        out.append(f'<text x="{PAD - 6}" y="{py(v) + 4}" text-anchor="end" font-size="11">{v:g}</text>')
    out.append(f'<text x="14" y="{H / 2}" font-size="11" transform="rotate(-90 14 {H / 2})" text-anchor="middle">{unit}</text>')
    out.append(f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle" font-size="11">pending messages</text>')
    for i, (name, key, scale, colour) in enumerate(series):
        pts = " ".join(f"{px(r['pending']):.1f},{py(r[key] / scale):.1f}" for r in rows)
        out.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for r in rows:
            out.append(f'<circle cx="{px(r["pending"]):.1f}" cy="{py(r[key] / scale):.1f}" r="3" fill="{colour}"/>')
        out.append(f'<text x="{PAD + 10}" y="{44 + 14 * i}" font-size="11" fill="{colour}">{name}</text>')
    out.append("</g>")
    return out


def nice(v):
    m = 10 ** math.floor(math.log10(max(v, 1e-9)))
    for f in (1, 2, 5, 10):
        if v <= f * m:
            return f * m
    return 10 * m


rss_max = nice(max(r["rss_restart"] for r in rows) / 2**20 * 1.1)
t_max = nice(max(max(r["restart_first_fire_ms"], r["restart_ready_ms"]) for r in rows) / 1000 * 1.1)
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{H}" font-family="sans-serif">',
       '<rect width="100%" height="100%" fill="white"/>']
svg += panel(0, "RSS after a restart", [("RSS", "rss_restart", 2**20, "#1f77b4")], "MiB", rss_max)
svg += panel(W, "Restart after kill -9", [("first fire", "restart_first_fire_ms", 1000, "#d62728"),
                                           ("consuming", "restart_ready_ms", 1000, "#2ca02c")], "seconds", t_max)
svg.append("</svg>")
open(sys.argv[2], "w").write("\n".join(svg) + "\n")

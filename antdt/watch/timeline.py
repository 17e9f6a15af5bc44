"""A job's lease timeline as inline SVG (:func:`timeline_svg`): the picture the tracking run's
``timeline.png`` shows after the job (``pipeline/tracking/timeline.py``), drawn on the
scheduler while the job runs, so its page needs no plotting library in the browser and nothing
from the internet::

    worker0 |[#12 finished][#15 finished] X [#31 open.....]      one lane per worker, one bar
    worker1 |[#13 finished.....][#22 revoked]>[#40 split]        per lease, coloured by how it
            +----------------------------------------------     ended (open: still leased);
    rows    |                          .------------------      marks: controller actions
            |           .-------------'                         rows trained, counted as each
            0 s                                         42 s    lease ends

Every text in it is escaped here (worker labels, action kinds, reasons in the marks' tooltips):
the page inserts the SVG as it is.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

OUTCOME_COLOURS = {"finished": "#009E73", "revoked": "#E69F00", "split": "#56B4E9",
                   "quarantined": "#CC79A7", "lost": "#D55E00", "open": "#999999"}
"""The tracking run's timeline colours (Okabe-Ito), and grey for a lease still open."""

ACTION_SHAPES = {"reassign": "M-5,-5 L5,0 L-5,5 Z", "split": "M0,-6 L6,0 L0,6 L-6,0 Z",
                 "revoke": "M-5,-3 L-3,-5 L0,-2 L3,-5 L5,-3 L2,0 "
                           "L5,3 L3,5 L0,2 L-3,5 L-5,3 L-2,0 Z",
                 "retire": "M-5,-5 L5,-5 L0,5 Z",
                 "adjust_batch": "M-4,-4 L4,-4 L4,4 L-4,4 Z"}
"""The marks' shapes per action kind (paths around the mark's point); other kinds: a circle."""

WIDTH = 960
LEFT = 150
"""Room for the lane labels."""
RIGHT = 20
LANE = 18
ROWS_PANEL = 70
TOP = 24


def timeline_svg(lanes: Sequence[str], spans: Sequence[Mapping[str, Any]],
                 marks: Sequence[Mapping[str, Any]], now: float) -> str:
    """The SVG of ``spans`` (``{"worker", "lease_id", "start", "end", "rows", "outcome"}``,
    seconds since training started) and ``marks`` (``{"time", "worker", "action", "rows",
    "reason"}``) on one lane per worker label (``lanes``, plus any label only a span or a mark
    names; ``worker2`` above ``worker10``), over ``[0, now]``."""
    names = sorted(set(lanes) | {str(x["worker"]) for x in (*spans, *marks)}, key=_natural)
    lane_of = {name: i for i, name in enumerate(names)}
    end = max([now, 1e-9, *(float(s["end"]) for s in spans), *(float(m["time"]) for m in marks)])
    plot = WIDTH - LEFT - RIGHT
    lanes_h = max(1, len(names)) * LANE
    height = TOP + lanes_h + 20 + ROWS_PANEL + 30

    def x(t: float) -> float:
        return LEFT + plot * max(0.0, t) / end

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" width="{WIDTH}" '
           f'height="{height}" viewBox="0 0 {WIDTH} {height}" role="img" '
           f'aria-label="lease timeline">',
           f'<text x="{LEFT}" y="14" class="key">{_key(spans)}</text>']
    for name, i in lane_of.items():
        y = TOP + i * LANE
        if i % 2:
            out.append(f'<rect x="{LEFT}" y="{y}" width="{plot}" height="{LANE}" '
                       f'fill="#f3f3f3"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + LANE - 5}" text-anchor="end" '
                   f'class="lane">{_e(name)}</text>')
    for span in spans:
        y = TOP + lane_of[str(span["worker"])] * LANE + 2
        x0, x1 = x(float(span["start"])), x(float(span["end"]))
        colour = OUTCOME_COLOURS.get(str(span["outcome"]), "#444444")
        out.append(f'<rect x="{x0:.1f}" y="{y}" width="{max(x1 - x0, 1.0):.1f}" '
                   f'height="{LANE - 4}" fill="{colour}" stroke="white" stroke-width="0.6">'
                   f'<title>lease #{_e(span["lease_id"])}: {_e(span["outcome"])}, '
                   f'{int(span["rows"]):,} rows, {float(span["start"]):.1f}-'
                   f'{float(span["end"]):.1f} s</title></rect>')
    for mark in marks:
        middle = TOP + (lane_of[str(mark["worker"])] + 0.5) * LANE
        shape = ACTION_SHAPES.get(str(mark["action"]))
        title = (f'<title>{_e(mark["action"])} at {float(mark["time"]):.1f} s: '
                 f'{_e(mark["reason"])}</title>')
        figure = f'<path d="{shape}"/>' if shape else '<circle r="4"/>'
        at = x(float(mark["time"]))
        out.append(f'<g class="mark" transform="translate({at:.1f},{middle:.1f})" '
                   f'fill="black" stroke="white" stroke-width="1">{figure}{title}</g>')
    out.extend(_rows_panel(spans, TOP + lanes_h + 20, x))
    axis = TOP + lanes_h + 20 + ROWS_PANEL
    out.append(f'<line x1="{LEFT}" y1="{axis}" x2="{WIDTH - RIGHT}" y2="{axis}" '
               f'stroke="#888"/>')
    for tick in _ticks(end):
        out.append(f'<text x="{x(tick):.1f}" y="{axis + 14}" text-anchor="middle" '
                   f'class="tick">{tick:g} s</text>')
    out.append(f'<text x="{LEFT + plot / 2}" y="{axis + 27}" text-anchor="middle" '
               f'class="tick">time since training started</text></svg>')
    return "".join(out)


def _rows_panel(spans: Sequence[Mapping[str, Any]], top: float,
                x: Callable[[float], float]) -> list[str]:
    """The rows trained so far, each lease's rows counted when it ended (open leases: now)."""
    total = sum(int(s["rows"]) for s in spans)
    out = [f'<text x="{LEFT - 6}" y="{top + 12}" text-anchor="end" class="lane">rows '
           f'trained</text>',
           f'<text x="{LEFT - 6}" y="{top + 26}" text-anchor="end" class="tick">'
           f'{total:,}</text>']
    if not total:
        return out
    points, done = [f"{LEFT},{top + ROWS_PANEL}"], 0
    for span in sorted(spans, key=lambda s: float(s["end"])):
        done += int(span["rows"])
        points.append(f"{x(float(span['end'])):.1f},"
                      f"{top + ROWS_PANEL * (1 - done / total):.1f}")
    out.append(f'<polyline points="{" ".join(points)}" fill="none" stroke="#333" '
               f'stroke-width="1.2"/>')
    return out


def _key(spans: Sequence[Mapping[str, Any]]) -> str:
    """The outcomes that occur, each in its colour."""
    present = {str(s["outcome"]) for s in spans}
    parts = [f'<tspan fill="{colour}">\u25a0 {outcome}</tspan> '
             for outcome, colour in OUTCOME_COLOURS.items() if outcome in present]
    return "lease outcome: " + ("".join(parts) if parts else "no lease yet")


def _ticks(end: float) -> list[float]:
    """About six round times from 0 to ``end``."""
    raw = end / 6
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    return [i * step for i in range(int(end / step) + 1)]


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _natural(label: str) -> list[tuple[int, int | str]]:
    """``worker2`` before ``worker10``."""
    return [(0, int(part)) if part.isdigit() else (1, part)
            for part in re.split(r"(\d+)", label) if part]

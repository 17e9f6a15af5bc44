"""The timeline PNG of one distributed training job: which worker trained which shard, when,
how each lease ended, and what the straggler controller did about it.

How to read the picture::

    worker0  |[#12 finished][#15 finished] X [#31 finished]       top panel: one lane per
    worker1  |[#13 finished.....][#22 revoked]>[#40 split]          worker, one bar per lease
    worker2  |[#14 lost....]                                        markers: controller actions
    worker10 |        v                                             (retired, never trained)
             +--------------------------------------------------
    rows     |                           .------------------       bottom panel: rows trained
             |          .---------------'                           so far
             +--------------------------------------------------
              0                         time since training started (s)

* **Lanes** (top panel): one per worker, sorted by label in natural order (``worker2`` before
  ``worker10``), first worker at the top. A worker that only appears in controller actions (it
  was retired before it trained anything) still gets its lane, so an empty lane is a worker that
  held no shard.
* **Bars**: one per lease, from the grant to the moment it ended, coloured by how it ended (one
  fixed colour per outcome in :data:`OUTCOMES`; ``lost`` is also hatched, so it survives a
  grey-scale print). A thin white edge separates back-to-back leases; wide enough bars carry
  their lease id (``#12``) to match the controller's log. Gaps in a lane are a worker waiting
  for work (or for the ledger), long bars next to short ones are stragglers.
* **Markers**: one per controller action, on the lane of the worker it targeted, at the time it
  was applied; one shape per action kind, black with a white rim so they stay visible on every
  bar colour. The outcome key above the lanes and the action key on their right list only
  what occurs; each action kind shows how often it was applied and the rows it moved.
* **Cumulative rows** (bottom panel, same time axis): the rows of every lease (whatever its
  outcome) spread uniformly over the lease's ``[start, end]``; a lease with ``start == end``
  counts all its rows at once. A flat stretch is the job training nothing; the curve ends at the
  total shown in the subtitle.

The figure is a plain :class:`matplotlib.figure.Figure` drawn by the Agg canvas: no pyplot, no
global state, no window, so the driver may render it from any thread. Its width is fixed; its
height grows with the number of workers (0.3 in a lane) up to 50 workers; beyond that lanes get
thinner, and above 40 workers only every k-th lane keeps its tick label, so 200 workers still
give a readable image of at most 1200 x 1810 pixels.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator, StrMethodFormatter

OUTCOMES = ("finished", "revoked", "split", "quarantined", "lost")
"""How a lease ended; ``lost``: the worker died holding it."""


@dataclass(frozen=True)
class LeaseSpan:
    """One lease of one worker, drawn as one bar."""

    worker: str
    """Worker label as it should appear on the y axis, e.g. ``worker0 (tcp://127.0.0.1:4321)``."""
    lease_id: int
    start: float
    """Seconds since the job started (training start)."""
    end: float
    """Seconds since the job started."""
    rows: int
    """Rows trained in this span."""
    outcome: str
    """One of :data:`OUTCOMES`."""


@dataclass(frozen=True)
class ActionMark:
    """One applied controller action, drawn as one marker."""

    time: float
    """Seconds since the job started."""
    worker: str
    """Same labels as :attr:`LeaseSpan.worker`."""
    action: str
    """``reassign``, ``split``, ``revoke``, ``retire``, ``adjust_batch``, or any other kind."""
    rows: int | None
    """Rows moved, if any."""
    reason: str
    """The policy's reason in words (kept for callers, not drawn)."""


# Okabe-Ito colours: distinguishable with the common colour-vision deficiencies.
OUTCOME_STYLE: dict[str, tuple[str, str | None]] = {
    "finished": ("#009E73", None),
    "revoked": ("#E69F00", None),
    "split": ("#56B4E9", None),
    "quarantined": ("#CC79A7", None),
    "lost": ("#D55E00", "////"),
}
"""Fill colour and hatch of each outcome's bars."""
_ACTION_MARKERS = {"reassign": ">", "split": "D", "revoke": "X", "retire": "v",
                   "adjust_batch": "s"}
_OTHER_MARKERS = ("*", "P", "h", "p", "^", "<", "o", "8")

_DPI = 100
_WIDTH_IN = 12.0
_LANE_IN = 0.3
_MIN_LANES_HEIGHT_IN = 2.0
_MAX_LANES_HEIGHT_IN = 15.0
_ROWS_PANEL_IN = 1.8
_MARGINS_IN = 1.3
_MAX_TICK_LABELS = 40
_BAR_HEIGHT = 0.8
_LANE_AXES_WIDTH_IN = 8.0
"""About the width of the lanes panel once the tick labels and legends have their room; used
only to decide whether a bar is wide enough for its lease id."""


def render_timeline(spans: Sequence[LeaseSpan], actions: Sequence[ActionMark], path: str, *,
                    title: str = "") -> str:
    """Write the timeline PNG of ``spans`` and ``actions`` to the local file ``path`` (its
    folder is created if missing) and return ``path``.

    Raises ``ValueError`` naming the lease (id and worker), the value and what was expected
    for a span with an unknown outcome, ``end < start``, negative rows or a non-finite time,
    and naming the action for an action with a non-finite time. No spans and no actions still
    give a valid PNG, one that says "no leases".
    """
    for span in spans:
        _check_span(span)
    for mark in actions:
        if not math.isfinite(mark.time):
            raise ValueError(f"action {mark.action!r} on worker {mark.worker!r}: time "
                             f"{mark.time!r} is not a finite number of seconds")

    lanes = sorted({s.worker for s in spans} | {a.worker for a in actions}, key=_natural_key)
    lanes_in = min(max(_LANE_IN * len(lanes), _MIN_LANES_HEIGHT_IN), _MAX_LANES_HEIGHT_IN)
    fig = Figure(figsize=(_WIDTH_IN, lanes_in + _ROWS_PANEL_IN + _MARGINS_IN), dpi=_DPI,
                 layout="constrained")
    FigureCanvasAgg(fig)
    total_rows = sum(s.rows for s in spans)
    counts = ", ".join(_count(n, noun) for n, noun in [
        (len(lanes), "worker"), (len(spans), "lease"), (total_rows, "row"),
        (len(actions), "controller action")])
    fig.suptitle(f"{title}\n{counts}" if title else counts)
    message: dict[str, Any] = {"ha": "center", "va": "center", "fontsize": 20, "color": "0.4"}
    if not lanes:
        fig.text(0.5, 0.5, "no leases", **message)
    else:
        lanes_ax, rows_ax = fig.subplots(2, 1, sharex=True,
                                         height_ratios=[lanes_in, _ROWS_PANEL_IN])
        times = [t for s in spans for t in (s.start, s.end)] + [a.time for a in actions]
        left, right = min(0.0, *times), max(0.0, *times)
        _draw_lanes(lanes_ax, lanes, spans, actions, lanes_in, right - left)
        _draw_rows(rows_ax, spans)
        pad = 0.02 * (right - left) or 1.0
        rows_ax.set_xlim(left - pad, right + pad)
        rows_ax.set_xlabel("time since training started (s)")
        if not spans:
            lanes_ax.text(0.5, 0.5, "no leases", transform=lanes_ax.transAxes, **message)

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png")
    fig.clear()
    return path


def cumulative_rows(spans: Sequence[LeaseSpan]) -> tuple[np.ndarray, np.ndarray]:
    """Rows trained up to each time, as drawn in the bottom panel: ``(times, rows)``, both of
    shape ``(2 * k,)`` for the ``k`` distinct span boundaries, each time twice (value just
    before it, value at it) so a zero-length span is a vertical step. Each span's rows are
    spread uniformly over ``[start, end]``; between two boundaries the curve is linear, so
    joining the points draws it exactly. Empty spans give two empty arrays.
    """
    if not spans:
        return np.zeros(0), np.zeros(0)
    start = np.array([s.start for s in spans], dtype=float)
    end = np.array([s.end for s in spans], dtype=float)
    rows = np.array([s.rows for s in spans], dtype=float)
    instant = end == start
    rate = np.where(instant, 0.0, rows / np.where(instant, 1.0, end - start))

    times, inverse = np.unique(np.concatenate([start, end]), return_inverse=True)
    n = len(spans)
    slope_change = np.bincount(inverse, np.concatenate([rate, -rate]), minlength=len(times))
    jump = np.bincount(inverse[:n], np.where(instant, rows, 0.0), minlength=len(times))
    slope_after = np.cumsum(slope_change)
    ramp = np.concatenate([[0.0], slope_after[:-1] * np.diff(times)])
    after = np.cumsum(ramp + jump)
    before = after - jump
    return np.repeat(times, 2), np.column_stack([before, after]).ravel()


def _check_span(span: LeaseSpan) -> None:
    where = f"lease {span.lease_id} on worker {span.worker!r}"
    if span.outcome not in OUTCOMES:
        raise ValueError(f"{where}: outcome {span.outcome!r} is not one of {OUTCOMES}")
    if not (math.isfinite(span.start) and math.isfinite(span.end)):
        raise ValueError(f"{where}: start {span.start!r} and end {span.end!r} must be finite "
                         "numbers of seconds")
    if span.end < span.start:
        raise ValueError(f"{where}: end {span.end!r} is before start {span.start!r} "
                         "(expected end >= start)")
    if span.rows < 0:
        raise ValueError(f"{where}: rows {span.rows!r} is negative (expected rows >= 0)")


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'s' * (n != 1)}"


def _natural_key(label: str) -> list[tuple[int, int | str]]:
    """Sort key that orders the numbers inside labels by value: ``worker2`` < ``worker10``."""
    return [(0, int(part)) if part.isdigit() else (1, part)
            for part in re.split(r"(\d+)", label) if part]


def _draw_lanes(ax: Axes, lanes: list[str], spans: Sequence[LeaseSpan],
                actions: Sequence[ActionMark], lanes_in: float, duration: float) -> None:
    lane_of = {worker: i for i, worker in enumerate(lanes)}
    lane_pt = 72.0 * lanes_in / len(lanes)
    step = math.ceil(len(lanes) / _MAX_TICK_LABELS)
    if step == 1:
        for i in range(1, len(lanes), 2):
            ax.axhspan(i - 0.5, i + 0.5, color="0.95", zorder=0, linewidth=0)
    else:
        ax.grid(axis="y", color="0.9", linewidth=0.5)

    # One collection per outcome, not one patch per lease: thousands of leases stay fast.
    pt_per_s = 72.0 * _LANE_AXES_WIDTH_IN / (duration or 1.0)
    half = _BAR_HEIGHT / 2
    outcome_handles = []
    for outcome in OUTCOMES:
        group = [s for s in spans if s.outcome == outcome]
        if not group:
            continue
        colour, hatch = OUTCOME_STYLE[outcome]
        boxes = [[(s.start, y - half), (s.start, y + half), (s.end, y + half), (s.end, y - half)]
                 for s in group for y in [lane_of[s.worker]]]
        ax.add_collection(PolyCollection(boxes, facecolors=colour, edgecolors="white",
                                         linewidths=0.6, hatch=hatch, zorder=2))
        outcome_handles.append(Patch(facecolor=colour, edgecolor="white", hatch=hatch,
                                     label=outcome))
        if lane_pt >= 12:
            for s in group:
                label = f"#{s.lease_id}"
                if (s.end - s.start) * pt_per_s >= 6 * len(label) + 6:
                    ax.text((s.start + s.end) / 2, lane_of[s.worker], label, ha="center",
                            va="center", fontsize=7, clip_on=True, zorder=3)

    present = {a.action for a in actions}
    kinds = [k for k in _ACTION_MARKERS if k in present] + sorted(present - set(_ACTION_MARKERS))
    others = itertools.cycle(_OTHER_MARKERS)
    marker_size = min(max(0.75 * lane_pt, 8.0), 10.0)
    action_handles = []
    for kind in kinds:
        marker = _ACTION_MARKERS.get(kind) or next(others)
        group_a = [a for a in actions if a.action == kind]
        moved = [a.rows for a in group_a if a.rows is not None]
        label = f"{kind} ({len(group_a)}" + f", {sum(moved):,} rows moved" * bool(moved) + ")"
        ax.plot([a.time for a in group_a], [lane_of[a.worker] for a in group_a],
                linestyle="none", marker=marker, markersize=marker_size,
                markerfacecolor="black", markeredgecolor="white", markeredgewidth=0.8,
                zorder=4)
        action_handles.append(Line2D([], [], linestyle="none", marker=marker, markersize=7,
                                     markerfacecolor="black", markeredgecolor="white",
                                     label=label))

    # Outcomes in one row above the lanes, actions beside them: neither can cover the other.
    if action_handles:
        actions_key = ax.legend(handles=action_handles, title="controller action",
                                loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                                title_fontsize=9)
        ax.add_artist(actions_key)  # the next ax.legend() call would replace it otherwise
        actions_key.set_clip_on(False)  # add_artist clips to the axes: layout would ignore it
    if outcome_handles:
        ax.legend(handles=outcome_handles, loc="lower left", bbox_to_anchor=(0.0, 1.0),
                  ncols=len(outcome_handles), fontsize=8, frameon=False, title="lease outcome",
                  title_fontsize=8, alignment="left")

    ax.set_yticks(range(0, len(lanes), step), lanes[::step], fontsize=8 if step == 1 else 7)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_ylabel("worker" + f" (labelled every {step} lanes)" * (step > 1))
    ax.grid(axis="x", color="0.85", linewidth=0.5)
    ax.set_axisbelow(True)


def _draw_rows(ax: Axes, spans: Sequence[LeaseSpan]) -> None:
    times, rows = cumulative_rows(spans)
    if len(times):
        ax.plot(times, rows, color="0.2", linewidth=1.2)
        ax.fill_between(times, rows, color="0.2", alpha=0.12, linewidth=0)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("rows trained\n(cumulative)")
    ax.yaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    ax.grid(color="0.85", linewidth=0.5)

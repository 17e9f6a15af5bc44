"""Daily retraining that continues yesterday's model: which way a day trains (:func:`choose`)
and the day check that guards it (:func:`check_day`), as plain functions the DAG's steps
(:mod:`pipeline.workflows.retrain`) and ``antdt bench retrain`` share.

Two ways (the DAG's ``retrain`` param):

- ``incremental`` (the default): start from the champion (its tables, dense layers and both
  optimisers' state) and train one pass over the days since the champion's data, normally one.
- ``window``: train the ``train_days`` window from scratch, as the DAG always did.

An incremental day trains the window from scratch instead, with fresh optimiser state, when
there is no champion yet, every ``refresh_every`` days of a chain (Adagrad's accumulators only
grow, so a long chain learns ever more slowly), when the schema changed, when the champion's
data ends before the window (a gap) or covers it already, and when the day check failed: a day
that looks unlike the recent days is never trained into the champion's chain. What a chain is
made of is recorded on each version (:class:`Chain`), so any version can be traced to its last
full refresh.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import median
from typing import Literal

Way = Literal["incremental", "window"]
WAYS: tuple[Way, ...] = ("incremental", "window")

TAG = "antdt.retrain"
"""The prefix of a version's chain tags (:meth:`Chain.tags`)."""

ROWS_RATIO = 2.0
"""The day check: a day's rows within this factor of the recent days' median."""
CTR_CHANGE = 0.5
"""The day check: a day's click rate within this share of the recent days' median (a weekly
cycle moves it by a fifth or so)."""
NULL_CHANGE = 0.1
"""The day check: a column's share of nulls within this of the recent days' highest."""


@dataclass(frozen=True)
class Chain:
    """What a version says of the chain it ends: the way it trained, the days it trained, the
    day its chain was last trained from scratch (``refreshed``) and the schema's digest."""

    version: str
    way: Way
    days: tuple[str, ...]
    refreshed: str
    schema: str

    def tags(self) -> dict[str, str]:
        return {f"{TAG}.way": self.way, f"{TAG}.days": ",".join(self.days),
                f"{TAG}.refreshed": self.refreshed, f"{TAG}.schema": self.schema}

    @classmethod
    def from_tags(cls, version: str, tags: Mapping[str, str]) -> Chain | None:
        """The chain a version's run recorded (None: a version trained before chains were
        recorded, or by hand)."""
        try:
            way = tags[f"{TAG}.way"]
            if way not in WAYS:
                return None
            return cls(version, way, tuple(tags[f"{TAG}.days"].split(",")),  # type: ignore
                       tags[f"{TAG}.refreshed"], tags[f"{TAG}.schema"])
        except KeyError:
            return None


@dataclass(frozen=True)
class Choice:
    """How a day trains: ``way``, the ``days`` it trains, the version it starts from (None:
    the seed) and why, as a person reads it."""

    way: Way
    days: tuple[str, ...]
    start: str | None
    reason: str


def choose(asked: Way, day: str, window: Sequence[str], champion: Chain | None,
           refresh_every: int, schema: str, check: str | None = None) -> Choice:
    """The way day ``day`` trains (see the module docstring): ``window`` is the days a window
    retrain would train, ``champion`` the champion's chain, ``schema`` the digest of today's
    schema, ``check`` why the day check failed (None: it passed).

    >>> chain = Chain("7", "incremental", ("2026-11-06",), "2026-11-02", "s")
    >>> choose("incremental", "2026-11-08", ["2026-11-02", "2026-11-07"], chain, 7, "s")
    Choice(way='incremental', days=('2026-11-07',), start='7', reason='continues version 7 (last trained from scratch on 2026-11-02)')
    >>> choose("incremental", "2026-11-09", ["2026-11-03", "2026-11-08"], chain, 7, "s").reason
    'refresh: the chain was last trained from scratch on 2026-11-02, 7 days ago (refresh_every 7)'
    """
    def window_way(reason: str) -> Choice:
        return Choice("window", tuple(window), None, reason)

    if asked == "window":
        return window_way("retrain=window")
    if champion is None:
        return window_way("no champion yet")
    if check is not None:
        return window_way(f"the day check failed: {check}")
    if champion.schema != schema:
        return window_way("the schema changed since the champion trained")
    age = (_date(day) - _date(champion.refreshed)).days
    if age >= refresh_every:
        return window_way(f"refresh: the chain was last trained from scratch on "
                          f"{champion.refreshed}, {age} days ago (refresh_every {refresh_every})")
    last = max(champion.days)
    new = tuple(d for d in window if d > last)
    if not new:
        return window_way(f"the champion (version {champion.version}) trained every day of the "
                          "window already")
    if _date(window[0]) > _date(last) + dt.timedelta(days=1):
        return window_way(f"the champion's data ends on {last}, before the window")
    return Choice("incremental", new, champion.version,
                  f"continues version {champion.version} (last trained from scratch on "
                  f"{champion.refreshed})")


def chain_of(choice: Choice, version: str, day: str, champion: Chain | None,
             schema: str) -> Chain:
    """The chain the version trained by ``choice`` on ``day`` ends."""
    refreshed = day if choice.way == "window" or champion is None else champion.refreshed
    return Chain(version, choice.way, choice.days, refreshed, schema)


@dataclass(frozen=True)
class DayStats:
    """What the day check compares: a day's rows, click rate and each column's share of
    nulls."""

    rows: int
    ctr: float
    nulls: Mapping[str, float]


def check_day(day: DayStats, recent: Sequence[DayStats]) -> str | None:
    """Why ``day`` looks unlike the ``recent`` days (None: it does not, or there are none to
    compare with): its rows off their median by more than :data:`ROWS_RATIO`, its click rate
    off theirs by more than :data:`CTR_CHANGE` of it, a column's nulls above their highest by
    more than :data:`NULL_CHANGE`."""
    if not recent:
        return None
    rows = median(d.rows for d in recent)
    if not rows / ROWS_RATIO <= day.rows <= rows * ROWS_RATIO:
        return f"{day.rows:,} rows, the recent days' median is {rows:,.0f}"
    ctr = median(d.ctr for d in recent)
    if abs(day.ctr - ctr) > CTR_CHANGE * ctr:
        return f"click rate {day.ctr:.3f}, the recent days' median is {ctr:.3f}"
    for column, share in day.nulls.items():
        highest = max(d.nulls.get(column, 0.0) for d in recent)
        if share > highest + NULL_CHANGE:
            return f"column {column} is {share:.1%} null, at most {highest:.1%} on the recent days"
    return None


def day_stats(paths: Sequence[str], label: str) -> DayStats:
    """:class:`DayStats` of a day's Parquet files: the rows and nulls from their footers, the
    click rate from the label column (the only column read)."""
    import pyarrow.compute as pc

    from data.files import expand, open_parquet

    rows, clicks = 0, 0.0
    nulls: dict[str, int] = {}
    for path in expand(list(paths)):
        with open_parquet(path) as parquet:
            meta = parquet.metadata
            rows += meta.num_rows
            for group in range(meta.num_row_groups):
                for index in range(meta.num_columns):
                    column = meta.row_group(group).column(index)
                    stats = column.statistics
                    if stats is not None and stats.has_null_count:
                        name = column.path_in_schema.split(".")[0]
                        nulls[name] = nulls.get(name, 0) + stats.null_count
            clicks += pc.sum(parquet.read(columns=[label]).column(label)).as_py() or 0
    return DayStats(rows, clicks / max(rows, 1),
                    {name: count / max(rows, 1) for name, count in nulls.items()})


def _date(text: str) -> dt.date:
    return dt.date.fromisoformat(text)

"""Drift for the synthetic data (:mod:`data.synth`): the hidden click model moves from day to day.

With a :class:`Drift`, day 0's model is drawn and calibrated as the default data's is (not the
same draw: the ids of all later days are drawn with it), and each later day ``d`` has a model
derived from day ``d - 1``'s with a random stream keyed by ``(seed, d)``:

- **rotation**: every first-order weight vector (the dense weights; each sparse feature's per-id
  weights) turns by ``rotate`` radians towards an independent fresh draw ``z`` from the same prior,
  ``w_d = cos(rotate) * w_{d-1} + sin(rotate) * z_d``. The variance stays that of the prior (the
  logit's scale is stable) while the correlation with day 0's weights falls as
  ``cos(rotate) ** d``. The pairwise (FM) terms do not move;
- **new ids**: each day ``c >= 1`` a cohort of ``ceil(new_ids * cardinality)`` ids no day before
  has used arrives in every sparse feature. On day ``d >= c`` the cohort takes a share
  ``new_ids * 0.5 ** ((d - c) / id_half_life_days)`` of the feature's ids (Zipf-like within the
  cohort, as the base vocabulary is); the base vocabulary keeps the rest. A new id's weight comes
  from the same prior as a base id of the same frequency rank within its group;
- **weekly cycle**: each day's model is calibrated anew as day 0's is (logit standard deviation
  about 1.6, click-through rate 25%: without it the base rate and the oracle's AUC would wander
  with the weights), then its bias moves by ``weekly * sin(2 pi d / 7)`` (logit units), so the
  click-through rate rises and falls over a week and the oracle's AUC stays about day 0's;
- **an abrupt shift**: on ``shift_day`` (by default the middle day of the run) the first-order
  weights of a share ``shift`` of the features (dense and sparse, chosen at random) flip sign, and
  stay flipped (they keep rotating from there).

So a model frozen on day 0 loses AUC day by day and at once on ``shift_day``, a model retrained on
a trailing window lags, and one trained incrementally can keep up; the oracle of each day is that
day's own model. Every id of every day is drawn up front so that no two share an embedding bucket:
a drifting feature's ``num_embeddings`` is twice its base cardinality plus all its cohorts, so it
grows with the number of days (about ``2 * (1 + new_ids * (days - 1))`` times the base
cardinality). A string feature's Parquet dictionary lists every day's ids from day 0 on (as it
lists every id without drift); the rows of a day use only the ids that have arrived.

This module is numpy only and knows nothing of the generator's model classes: it holds the
settings and the array-level steps that :mod:`data.synth` applies.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from antdt.errors import ConfigError
from data.zipf import zipf_ranks

_WEEK_DAYS = 7


@dataclass(frozen=True)
class Drift:
    """How the hidden click model moves from day to day (module docstring).

    ``rotate``: radians a day the first-order weights turn towards a fresh draw; ``new_ids``: share
    of a sparse feature's traffic that the day's new ids take on their first day (and the size of
    the day's cohort relative to the base cardinality); ``id_half_life_days``: half-life of a
    cohort's share; ``weekly``: amplitude of the bias's weekly cycle, in logit units; ``shift_day``:
    the day of the abrupt shift (None: the middle day of the run, see :meth:`for_days`); ``shift``:
    share of the features whose first-order weights flip sign on that day.
    """

    rotate: float = 0.25
    new_ids: float = 0.05
    id_half_life_days: float = 3.0
    weekly: float = 0.3
    shift_day: int | None = None
    shift: float = 0.3

    def __post_init__(self) -> None:
        for name, value, low, high in (("rotate", self.rotate, 0.0, math.pi / 2),
                                       ("new_ids", self.new_ids, 0.0, 0.5),
                                       ("weekly", self.weekly, 0.0, 5.0),
                                       ("shift", self.shift, 0.0, 1.0)):
            if not low <= value <= high:
                raise ConfigError(f"drift: {name} must be in [{low}, {high:g}], found {value}")
        if not self.id_half_life_days > 0:
            raise ConfigError(f"drift: id_half_life_days must be > 0, found "
                              f"{self.id_half_life_days}")
        if self.shift_day is not None and self.shift_day < 1:
            raise ConfigError(f"drift: shift_day must be >= 1 (day 0 is the base model), found "
                              f"{self.shift_day}")
        settled = self.new_ids / (1.0 - 0.5 ** (1.0 / self.id_half_life_days))
        if settled >= 1.0:
            raise ConfigError(f"drift: the new ids' share of traffic once settled, new_ids / "
                              f"(1 - 0.5 ** (1 / id_half_life_days)), must be < 1, found "
                              f"{settled:.3f} (new_ids={self.new_ids}, "
                              f"id_half_life_days={self.id_half_life_days})")

    def for_days(self, days: int) -> Drift:
        """This drift with ``shift_day`` set: the middle day of a ``days``-day run when unset."""
        return self if self.shift_day is not None else replace(self, shift_day=max(1, days // 2))

    def as_dict(self) -> dict[str, Any]:
        """The settings, for the oracle file (so a benchmark can tell drifting data apart)."""
        return asdict(self)

    def cohort_size(self, cardinality: int) -> int:
        """Ids a day's cohort brings to a feature of ``cardinality`` base ids (0: no new ids)."""
        return math.ceil(self.new_ids * cardinality) if self.new_ids else 0

    def cohort_shares(self, day: int) -> tuple[float, ...]:
        """Shares of day ``day``'s traffic on the cohorts that arrived on days ``1..day``."""
        if not self.new_ids:
            return ()
        return tuple(self.new_ids * 0.5 ** ((day - c) / self.id_half_life_days)
                     for c in range(1, day + 1))

    def bias_offset(self, day: int) -> float:
        """The weekly cycle's offset to the bias on ``day`` (0 on day 0)."""
        return self.weekly * math.sin(2.0 * math.pi * day / _WEEK_DAYS)


def group_ranks(cardinality: int, cohort_size: int, cohorts: int) -> npt.NDArray[np.int64]:
    """Each id's frequency rank within its group: the base ids ``0..cardinality-1``, then each of
    ``cohorts`` cohorts ``0..cohort_size-1``. Shape ``(cardinality + cohorts * cohort_size,)``."""
    return np.concatenate([np.arange(cardinality, dtype=np.int64),
                           np.tile(np.arange(cohort_size, dtype=np.int64), cohorts)])


def turn(weights: npt.NDArray[np.float64], fresh: npt.NDArray[np.float64], angle: float
         ) -> npt.NDArray[np.float64]:
    """``cos(angle) * weights + sin(angle) * fresh``: a step towards an independent draw from the
    same prior that keeps the variance."""
    return math.cos(angle) * weights + math.sin(angle) * fresh


def mix_new_ids(rng: np.random.Generator, ranks: npt.NDArray[np.int64], cardinality: int,
                cohort_size: int, shares: tuple[float, ...], exponent: float
                ) -> npt.NDArray[np.int64]:
    """Move a share ``shares[j]`` of ``ranks`` (base ranks in ``[0, cardinality)``) to the ids of
    cohort ``j``, indices ``cardinality + j * cohort_size + r`` with ``r`` Zipf-like in
    ``[0, cohort_size)``; in place, returned for convenience."""
    cohort = np.searchsorted(np.cumsum(shares), rng.random(len(ranks)), side="right")
    young = cohort < len(shares)
    within = zipf_ranks(rng, int(young.sum()), cohort_size, exponent)
    ranks[young] = cardinality + cohort[young] * cohort_size + within
    return ranks

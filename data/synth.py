"""Criteo-like synthetic click data with a hidden true model, so a run's AUC has a ceiling to
compare with.

:func:`generate` writes ``out/date=YYYY-MM-DD/part-NNNNN.parquet`` (consecutive days from
2026-11-01, ``files_per_day`` files a day, row groups of ``row_group_rows``), ``out/schema.yaml``
and ``out/oracle.json``: the AUC and logloss of the true click probabilities, per day.

Columns: ``label`` (int8, 0/1), ``I1..I13`` dense (int64 counts, heavy-tailed: log-logistic, with
some zeros and some nulls), ``C1..C26`` sparse (int64 ids with Zipf-like frequencies, cardinalities
from 10 to 100,000 spaced geometrically, some nulls). Optionally ``S1``, a string feature, and
``M1``, a multi-valued ``list<int64>`` feature (0 to ~6 ids a row, some empty or null lists), so
those reader paths are exercised end to end; both are off by default to keep the default data
fast to read.

The hidden model is a logistic model with

- first-order terms: a weight per dense feature on ``log1p(count)`` (the reader's transform) and
  a weight per id of every sparse feature; an id's weight shrinks with its frequency rank
  (``1 / (1 + rank / 50)``), so the signal sits on ids a model sees often and the rare tail is
  weak: a DLRM can learn most of it from a couple of million rows;
- pairwise terms: a few pairs of low-cardinality sparse features interact through FM-style latent
  dot products (dimension 4), the kind a DLRM's dot interaction represents;
- a bias that puts the click-through rate near 25%.

Component scales are calibrated on a fixed sample so the logit has a standard deviation of about
1.6 (oracle AUC about 0.8) whatever ``num_dense``/``num_sparse`` are. Labels are
``Bernoulli(sigmoid(logit))``. Raw ids are drawn so that no two ids of a feature share an
embedding bucket under :mod:`data.hashing` (``num_embeddings`` is twice the cardinality):
hashing costs the model nothing, so the oracle is a fair ceiling.

By default the model is the same every day. With a :class:`data.drift.Drift` it moves from day to
day (weights that rotate, new ids each day whose popularity decays, a weekly cycle of the base rate
and one abrupt shift; :mod:`data.drift` says how), the oracle of each day is that day's model, and
``oracle.json`` records the drift's settings under ``"drift"``; the schema is the same for all days,
its ``num_embeddings`` sized for every day's ids. Without a drift, nothing of the above changes.

Everything is a function of the arguments: each row group draws from its own random stream keyed
by ``(seed, day, file, row group)`` (and a drifting day's model from its own stream keyed by
``(seed, day)``), so the same arguments give byte-identical files (with the
same numpy and pyarrow on the same kind of CPU: numpy's vectorised ``exp``/``log`` may round
differently on another instruction set). Rows are generated one row group at a time (bounded
memory), with numpy, vectorised per column, while a background thread encodes the previous row
group: about 0.5M rows/s on two cores.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import posixpath
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from antdt.errors import ConfigError
from data.drift import Drift, group_ranks, mix_new_ids, turn
from data.hashing import hash_arrow, hash_ints
from data.schema import Schema, SparseFeature
from data.zipf import zipf_ranks

logger = logging.getLogger(__name__)

START_DATE = dt.date(2026, 11, 1)
LABEL = "label"
STRING_FEATURE = "S1"
MULTI_VALUED_FEATURE = "M1"

_TARGET_LOGIT_STD = 1.6
_TARGET_CTR = 0.25
# Share of the logit's variance per component: dense, first-order sparse, pairwise.
_VARIANCE_SHARES = (0.3, 0.5, 0.2)
_RANK_DECAY = 50.0
_LATENT_DIM = 4
_MAX_PAIRS = 4
_PAIR_MAX_CARDINALITY = 2_000
_EXTRA_CARDINALITY = 1_000
_MULTI_MEAN_LENGTH = 2.0
_MULTI_NULL_RATE = 0.02
_CALIBRATION_ROWS = 65_536
_ORACLE_BINS = 1 << 18
# Stream keys of the random generators: the hidden model, its calibration sample, the rows, the
# model's drift from one day to the next.
_MODEL_STREAM, _CALIBRATION_STREAM, _ROWS_STREAM, _DRIFT_STREAM = 0, 1, 2, 3

Array = npt.NDArray[Any]


@dataclass(frozen=True)
class _DenseTruth:
    """Counts ``floor(exp(mu + sigma * z))``, ``z`` standard logistic; zero with ``zero_rate``,
    null with ``null_rate``."""

    name: str
    mu: float
    sigma: float
    zero_rate: float
    null_rate: float
    weight: float


@dataclass(frozen=True)
class _SparseTruth:
    """A sparse feature: the id of frequency rank ``r`` (Zipf-like, ``exponent``) is
    ``raw_ids[r]``, its weight ``weights[r]``, drawn from ``normal(0, prior_std[r])``.

    With drift, the ``cardinality`` base ids are followed by cohorts of ``cohort_size`` new ids,
    one a day; ``cohorts`` are the day's shares of traffic on the cohorts that have arrived
    (:func:`data.drift.mix_new_ids`), empty on day 0 and without drift.
    """

    feature: SparseFeature
    cardinality: int
    exponent: float
    null_rate: float
    raw_ids: Array
    weights: npt.NDArray[np.float64]
    prior_std: npt.NDArray[np.float64]
    cohort_size: int = 0
    cohorts: tuple[float, ...] = ()


@dataclass(frozen=True)
class _PairTruth:
    """An FM-style interaction of sparse features ``a`` and ``b`` (indices into ``sparse``)."""

    a: int
    b: int
    latent_a: npt.NDArray[np.float64]
    latent_b: npt.NDArray[np.float64]


@dataclass
class _Truth:
    """The hidden model: logit = bias + scales . (dense term, sparse term, pair term)."""

    dense: list[_DenseTruth]
    sparse: list[_SparseTruth]
    pairs: list[_PairTruth]
    scales: npt.NDArray[np.float64] = field(default_factory=lambda: np.ones(3))
    bias: float = 0.0

    def logit(self, terms: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """``terms`` ``(3, n)`` -> logits ``(n,)``."""
        return self.bias + self.scales @ terms


@dataclass(frozen=True)
class SynthResult:
    """What :func:`generate` wrote."""

    out: str
    schema: Schema
    files: list[str]
    rows: int
    oracle: dict[str, Any]


def write_parquet(path: str, data: pa.Table | Mapping[str, Any], *, row_group_rows: int) -> str:
    """Write a table (or a dict of numpy arrays / Arrow arrays / lists) as one Parquet file with
    row groups of ``row_group_rows``; ``path`` may be an fsspec URL. Returns ``path``."""
    table = data if isinstance(data, pa.Table) else pa.table(dict(data))
    fs, target = url_to_fs(path)
    parent = posixpath.dirname(target)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    with fs.open(target, "wb") as fh:
        pq.write_table(table, fh, row_group_size=row_group_rows)
    return path


def _distinct_bucket_ids(rng: np.random.Generator, feature: SparseFeature, cardinality: int
                         ) -> Array:
    """``cardinality`` raw values (ints, or strings for a string feature) whose buckets under
    :mod:`data.hashing` are pairwise distinct.

    Draws candidates for the ranks still open, keeps those landing in a free bucket (the first
    of several landing in the same one), and redraws the rest; each round is cheaper than the
    last because at most half the buckets are ever taken.
    """
    if cardinality >= feature.num_embeddings:
        raise ConfigError(f"feature {feature.name}: cardinality {cardinality} needs "
                          f"num_embeddings > {cardinality}, found {feature.num_embeddings}")
    strings = feature.type == "string"
    values: Array = np.empty(cardinality, dtype=object if strings else np.int64)
    taken = np.zeros(feature.num_embeddings, dtype=bool)
    open_ranks = np.arange(cardinality)
    while len(open_ranks):
        ints = rng.integers(1, 1 << 40, size=len(open_ranks), dtype=np.int64)
        if strings:
            candidates: Array = np.array([f"v{v:x}" for v in ints], dtype=object)
            buckets = hash_arrow(pa.array(candidates, type=pa.string()), feature.num_embeddings)
        else:
            candidates = ints
            buckets = hash_ints(ints, feature.num_embeddings)
        _, first = np.unique(buckets, return_index=True)
        keep = np.zeros(len(open_ranks), dtype=bool)
        keep[first] = True
        keep &= ~taken[buckets]
        values[open_ranks[keep]] = candidates[keep]
        taken[buckets[keep]] = True
        open_ranks = open_ranks[~keep]
    return values


def _build_truth(seed: int, num_dense: int, num_sparse: int, with_string: bool,
                 with_multi_valued: bool, drift: Drift | None = None, days: int = 1) -> _Truth:
    """Draw the hidden model (unscaled): feature distributions, weights and latent vectors; with
    ``drift``, also the ids and weights of the new ids of days ``1..days-1``."""
    rng = np.random.default_rng([seed, _MODEL_STREAM])
    dense = [_DenseTruth(name=f"I{i + 1}", mu=float(rng.uniform(-1.0, 3.0)),
                         sigma=float(rng.uniform(0.3, 0.8)),
                         zero_rate=float(rng.uniform(0.0, 0.3)),
                         null_rate=float(rng.choice([0.0, 0.01, 0.05])),
                         weight=float(rng.normal()))
             for i in range(num_dense)]
    def cohort_size(cardinality: int) -> int:
        """The ids a day after day 0 brings to a feature (none without drift)."""
        return drift.cohort_size(cardinality) if drift is not None else 0

    def ids(cardinality: int) -> int:
        """The feature's ids over all days: its base ids and a cohort a day after day 0."""
        return cardinality + (days - 1) * cohort_size(cardinality)

    specs: list[tuple[SparseFeature, int]] = []
    cardinalities = np.geomspace(10, 100_000, num_sparse).round().astype(int) if num_sparse \
        else np.array([], dtype=int)
    for i, cardinality in enumerate(cardinalities):
        specs.append((SparseFeature(f"C{i + 1}", 2 * ids(int(cardinality))), int(cardinality)))
    if with_string:
        specs.append((SparseFeature(STRING_FEATURE, 2 * ids(_EXTRA_CARDINALITY), type="string"),
                      _EXTRA_CARDINALITY))
    if with_multi_valued:
        specs.append((SparseFeature(MULTI_VALUED_FEATURE, 2 * ids(_EXTRA_CARDINALITY),
                                    multi_valued=True), _EXTRA_CARDINALITY))
    sparse: list[_SparseTruth] = []
    ranks_of: list[npt.NDArray[np.int64]] = []
    for feature, cardinality in specs:
        ranks = group_ranks(cardinality, cohort_size(cardinality), days - 1)
        strength = 1.0 / (1.0 + ranks / _RANK_DECAY)
        importance = rng.uniform(0.3, 1.0)
        sparse.append(_SparseTruth(
            feature=feature, cardinality=cardinality, exponent=float(rng.uniform(1.05, 1.3)),
            null_rate=_MULTI_NULL_RATE if feature.multi_valued
            else float(rng.choice([0.0, 0.0, 0.01, 0.03])),
            raw_ids=_distinct_bucket_ids(rng, feature, len(strength)),
            weights=importance * strength * rng.normal(size=len(strength)),
            prior_std=importance * strength, cohort_size=cohort_size(cardinality)))
        ranks_of.append(ranks)
    candidates = [i for i, s in enumerate(sparse)
                  if s.cardinality <= _PAIR_MAX_CARDINALITY and not s.feature.multi_valued]
    pairs: list[_PairTruth] = []
    if len(candidates) >= 2:
        for _ in range(min(_MAX_PAIRS, len(candidates) // 2)):
            a, b = (int(v) for v in rng.choice(candidates, size=2, replace=False))
            latent = [rng.normal(size=(len(ranks_of[i]), _LATENT_DIM))
                      / (1.0 + ranks_of[i][:, None] / _RANK_DECAY)
                      for i in (a, b)]
            pairs.append(_PairTruth(a=a, b=b, latent_a=latent[0], latent_b=latent[1]))
    return _Truth(dense=dense, sparse=sparse, pairs=pairs)


def _log_logistic_counts(rng: np.random.Generator, n: int, mu: float, scale: float
                         ) -> npt.NDArray[np.int64]:
    """``floor(exp(mu + scale * z))`` with ``z`` standard logistic: heavy-tailed counts (a
    log-logistic law, like log-normal with fatter tails), drawn with one ``log`` and one ``exp``."""
    u = rng.random(n, dtype=np.float32)
    np.clip(u, np.float32(1e-7), np.float32(1.0 - 1e-7), out=u)
    z = np.log(u / (np.float32(1.0) - u))
    z *= np.float32(scale)
    z += np.float32(mu)
    return np.exp(z, out=z).astype(np.int64)


def _mask(rng: np.random.Generator, n: int, rate: float) -> npt.NDArray[np.bool_] | None:
    """A random boolean mask with ``rate`` True, or None (no draw) when ``rate`` is 0."""
    return rng.random(n, dtype=np.float32) < rate if rate else None


def _rows(truth: _Truth, rng: np.random.Generator, n: int
          ) -> tuple[dict[str, pa.Array], npt.NDArray[np.float64]]:
    """``n`` rows of every feature column, and the logit terms ``(3, n)`` behind them."""
    columns: dict[str, pa.Array] = {}
    terms = np.zeros((3, n))
    for spec in truth.dense:
        counts = _log_logistic_counts(rng, n, spec.mu, spec.sigma)
        zeros = _mask(rng, n, spec.zero_rate)
        if zeros is not None:
            np.copyto(counts, 0, where=zeros)
        nulls = _mask(rng, n, spec.null_rate)
        feature = counts.astype(np.float32)
        feature += 1.0
        np.log(feature, out=feature)
        if nulls is not None:
            np.copyto(feature, 0.0, where=nulls)
        terms[0] += spec.weight * feature
        columns[spec.name] = pa.array(counts, mask=nulls)
    ranks: list[npt.NDArray[np.int64]] = []
    nulls_of: list[npt.NDArray[np.bool_] | None] = []
    for sparse in truth.sparse:
        name = sparse.feature.name
        nulls = _mask(rng, n, sparse.null_rate)
        if sparse.feature.multi_valued:
            columns[name] = _multi_valued_rows(sparse, rng, n, nulls, terms[1])
            ranks.append(np.zeros(n, dtype=np.int64))
        else:
            rank = _draw_ids(sparse, rng, n)
            weights = sparse.weights[rank]
            if nulls is not None:
                np.copyto(weights, 0.0, where=nulls)
            terms[1] += weights
            if sparse.feature.type == "string":
                columns[name] = pa.DictionaryArray.from_arrays(
                    pa.array(rank.astype(np.int32), mask=nulls),
                    pa.array(sparse.raw_ids, type=pa.string()))
            else:
                columns[name] = pa.array(sparse.raw_ids[rank], mask=nulls)
            ranks.append(rank)
        nulls_of.append(nulls)
    for pair in truth.pairs:
        dots = np.einsum("ij,ij->i", pair.latent_a[ranks[pair.a]], pair.latent_b[ranks[pair.b]])
        for nulls in (nulls_of[pair.a], nulls_of[pair.b]):
            if nulls is not None:
                np.copyto(dots, 0.0, where=nulls)
        terms[2] += dots
    return columns, terms


def _multi_valued_rows(spec: _SparseTruth, rng: np.random.Generator, n: int,
                       nulls: npt.NDArray[np.bool_] | None, first_order: npt.NDArray[np.float64]
                       ) -> pa.Array:
    """A ``list<int64>`` column; adds each row's summed id weights to ``first_order``."""
    lengths = rng.poisson(_MULTI_MEAN_LENGTH, n)
    if nulls is not None:
        lengths[nulls] = 0
    ranks = _draw_ids(spec, rng, int(lengths.sum()))
    rows = np.repeat(np.arange(n), lengths)
    first_order += np.bincount(rows, weights=spec.weights[ranks], minlength=n)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(spec.raw_ids[ranks]),
                                    mask=None if nulls is None else pa.array(nulls))


def _draw_ids(spec: _SparseTruth, rng: np.random.Generator, n: int) -> npt.NDArray[np.int64]:
    """``n`` ids of a feature (indices into its ``raw_ids``): Zipf-like base ranks, a share of
    them moved to the day's new ids when the feature drifts."""
    ranks = zipf_ranks(rng, n, spec.cardinality, spec.exponent)
    if spec.cohorts:
        mix_new_ids(rng, ranks, spec.cardinality, spec.cohort_size, spec.cohorts, spec.exponent)
    return ranks


def _next_day(previous: _Truth, drift: Drift, seed: int, day: int) -> _Truth:
    """Day ``day``'s model from day ``day - 1``'s under ``drift`` (:mod:`data.drift`): first-order
    weights turned (sign-flipped for a share of the features on the shift day), the day's new
    ids' traffic shares, pairs as before; calibrated anew like day 0's, then the bias moved by the
    weekly cycle.

    Calibrating each day keeps the oracle's AUC and the base rate where day 0 has them: without
    it, the logit's mean and spread would wander with the weights (a few popular ids carry much
    of the traffic, and day 0's draws sit off the prior's mean by chance), hiding the weekly cycle.
    """
    rng = np.random.default_rng([seed, _DRIFT_STREAM, day])
    signs = np.ones(len(previous.dense) + len(previous.sparse))
    if day == drift.shift_day:
        signs[rng.choice(len(signs), size=round(drift.shift * len(signs)), replace=False)] = -1.0
    dense_weights = turn(np.array([d.weight for d in previous.dense]),
                         rng.normal(size=len(previous.dense)), drift.rotate)
    dense = [replace(d, weight=float(w * sign))
             for d, w, sign in zip(previous.dense, dense_weights, signs)]
    sparse = [replace(s, cohorts=drift.cohort_shares(day),
                      weights=sign * turn(s.weights, s.prior_std * rng.normal(size=len(s.weights)),
                                          drift.rotate))
              for s, sign in zip(previous.sparse, signs[len(dense):])]
    truth = _Truth(dense=dense, sparse=sparse, pairs=previous.pairs)
    _calibrate(truth, np.random.default_rng([seed, _CALIBRATION_STREAM, day]))
    truth.bias += drift.bias_offset(day)
    return truth


def _calibrate(truth: _Truth, rng: np.random.Generator) -> None:
    """Scale the components to their variance shares and set the bias for the target CTR, on a
    sample of rows drawn with ``rng``."""
    _, terms = _rows(truth, rng, _CALIBRATION_ROWS)
    stds = terms.std(axis=1)
    shares = np.array(_VARIANCE_SHARES)
    active = stds > 0
    shares = np.where(active, shares, 0.0) / shares[active].sum()
    truth.scales = np.where(active, _TARGET_LOGIT_STD * np.sqrt(shares) / np.where(active, stds, 1),
                            0.0)
    centred = truth.scales @ terms
    low, high = -20.0, 20.0
    for _ in range(60):
        mid = (low + high) / 2
        if _sigmoid(mid + centred).mean() < _TARGET_CTR:
            low = mid
        else:
            high = mid
    truth.bias = (low + high) / 2


def _sigmoid(z: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    return 1.0 / (1.0 + np.exp(-z))


def _schema(truth: _Truth, source: str) -> Schema:
    return Schema(label=LABEL, dense=tuple(d.name for d in truth.dense),
                  sparse=tuple(s.feature for s in truth.sparse), source=source)


class _OracleDay:
    """AUC and logloss of the true probabilities of one day, accumulated chunk by chunk.

    AUC from histograms of the probabilities of positives and negatives over ``_ORACLE_BINS``
    bins (pairs in one bin count one half): bounded memory, error far below 1e-4.
    """

    def __init__(self) -> None:
        self.positives = np.zeros(_ORACLE_BINS, dtype=np.int64)
        self.negatives = np.zeros(_ORACLE_BINS, dtype=np.int64)
        self.loss = 0.0
        self.rows = 0

    def add(self, logit: npt.NDArray[np.float64], labels: npt.NDArray[np.bool_]) -> None:
        bins = np.minimum((_sigmoid(logit) * _ORACLE_BINS).astype(np.int64), _ORACLE_BINS - 1)
        self.positives += np.bincount(bins[labels], minlength=_ORACLE_BINS)
        self.negatives += np.bincount(bins[~labels], minlength=_ORACLE_BINS)
        # -log p = softplus(-z) for a positive, -log(1 - p) = softplus(z) for a negative.
        self.loss += float(np.logaddexp(0.0, np.where(labels, -logit, logit)).sum())
        self.rows += len(logit)

    def summary(self) -> dict[str, float | int]:
        positives, negatives = int(self.positives.sum()), int(self.negatives.sum())
        below = np.cumsum(self.negatives) - self.negatives
        pairs = positives * negatives
        wins = float((self.positives * (below + 0.5 * self.negatives)).sum())
        return {"auc": wins / pairs if pairs else float("nan"),
                "logloss": self.loss / self.rows if self.rows else float("nan"),
                "ctr": positives / self.rows if self.rows else float("nan"),
                "rows": self.rows}


def _split(total: int, parts: int) -> list[int]:
    """``total`` as ``parts`` near-equal non-negative integers, larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def generate(out: str, *, rows: int, days: int = 1, seed: int = 0, row_group_rows: int = 65536,
             files_per_day: int = 4, num_dense: int = 13, num_sparse: int = 26,
             with_string: bool = False, with_multi_valued: bool = False,
             drift: Drift | None = None, progress: Callable[[int], None] | None = None
             ) -> SynthResult:
    """Write synthetic data, its schema and its oracle under ``out`` (module docstring).

    ``rows`` are split evenly over ``days`` and each day's over ``files_per_day`` files; every
    file gets at least one row. ``with_string``/``with_multi_valued`` add the ``S1``/``M1``
    features. ``drift`` makes the model move from day to day (:mod:`data.drift`; its
    ``shift_day``, when unset, becomes the middle day). ``progress`` is called with the number of
    rows of each row group generated (the background writer is at most two row groups behind).
    """
    for name, value, least in (("rows", rows, 1), ("days", days, 1),
                               ("row_group_rows", row_group_rows, 1),
                               ("files_per_day", files_per_day, 1), ("num_dense", num_dense, 0),
                               ("num_sparse", num_sparse, 0)):
        if value < least:
            raise ConfigError(f"synthetic data: {name} must be >= {least}, found {value}")
    if rows < days * files_per_day:
        raise ConfigError(f"synthetic data: rows must be >= days * files_per_day "
                          f"({days} * {files_per_day}) so no file is empty, found {rows}")
    if num_sparse == 0 and not (with_string or with_multi_valued):
        raise ConfigError("synthetic data: expected at least one sparse feature, found "
                          "num_sparse=0 and no string or multi-valued feature")
    if drift is not None:
        drift = drift.for_days(days)
    base = _build_truth(seed, num_dense, num_sparse, with_string, with_multi_valued, drift, days)
    _calibrate(base, np.random.default_rng([seed, _CALIBRATION_STREAM]))
    truth = base
    schema = _schema(base, source=_join(out, "schema.yaml"))
    fs, root = url_to_fs(out)
    fs.makedirs(root, exist_ok=True)
    files: list[str] = []
    per_day: dict[str, dict[str, float | int]] = {}
    with _ParquetSink(fs) as sink:
        for day, day_rows in enumerate(_split(rows, days)):
            date = (START_DATE + dt.timedelta(days=day)).isoformat()
            if drift is not None and day > 0:
                truth = _next_day(truth, drift, seed, day)
            oracle = _OracleDay()
            fs.makedirs(posixpath.join(root, f"date={date}"), exist_ok=True)
            for part, file_rows in enumerate(_split(day_rows, files_per_day)):
                path = posixpath.join(root, f"date={date}", f"part-{part:05d}.parquet")
                for group, first in enumerate(range(0, file_rows, row_group_rows)):
                    n = min(row_group_rows, file_rows - first)
                    rng = np.random.default_rng([seed, _ROWS_STREAM, day, part, group])
                    sink.write(path, _row_group(truth, schema, rng, n, oracle))
                    if progress is not None:
                        progress(n)
                files.append(fs.unstrip_protocol(path) if "://" in out else path)
            per_day[date] = oracle.summary()
            logger.info("synthesised %s: %d rows, oracle AUC %.4f", date, day_rows,
                        per_day[date]["auc"])
    schema.to_yaml(schema.source)
    oracle_doc: dict[str, Any] = {"per_day": per_day, "seed": seed, "rows": rows}
    if drift is not None:
        oracle_doc["drift"] = drift.as_dict()
    with fs.open(posixpath.join(root, "oracle.json"), "w") as fh:
        json.dump(oracle_doc, fh, indent=2, sort_keys=True)
    return SynthResult(out=out, schema=schema, files=files, rows=rows, oracle=oracle_doc)


def _join(out: str, name: str) -> str:
    return out.rstrip("/") + "/" + name


def _row_group(truth: _Truth, schema: Schema, rng: np.random.Generator, n: int,
               oracle: _OracleDay) -> pa.Table:
    """``n`` rows with labels drawn from the true model; the oracle sees their probabilities."""
    columns, terms = _rows(truth, rng, n)
    logit = truth.logit(terms)
    labels = rng.random(n) < _sigmoid(logit)
    oracle.add(logit, labels)
    return pa.table({LABEL: pa.array(labels.astype(np.int8)),
                     **{name: columns[name] for name in schema.columns[1:]}})


class _ParquetSink:
    """Writes row groups to Parquet files in one background thread, in submission order.

    Generating rows (numpy) and encoding them (pyarrow) both release the GIL, so on two cores
    they overlap. At most ``depth`` row groups wait to be written (bounded memory); an error in
    the writer surfaces at the next ``write`` or at the end of the ``with`` block.
    """

    def __init__(self, fs: Any, depth: int = 2) -> None:
        self._fs = fs
        self._depth = depth
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="antdt-synth-writer")
        self._pending: deque[Future[None]] = deque()
        self._path: str | None = None
        self._file: Any = None
        self._writer: pq.ParquetWriter | None = None

    def write(self, path: str, table: pa.Table) -> None:
        while len(self._pending) >= self._depth:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(self._write, path, table))

    def _write(self, path: str, table: pa.Table) -> None:
        if path != self._path:
            self._close_file()
            self._file = self._fs.open(path, "wb")
            self._writer = pq.ParquetWriter(self._file, table.schema)
            self._path = path
        assert self._writer is not None
        self._writer.write_table(table, row_group_size=len(table))

    def _close_file(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._file.close()
        self._writer = self._file = self._path = None

    def __enter__(self) -> _ParquetSink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            while self._pending:
                self._pending.popleft().result()
        finally:
            self._pool.submit(self._close_file).result()
            self._pool.shutdown()

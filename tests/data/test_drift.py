"""Drifting synthetic data: the settings, the day-to-day model, and what the generator writes."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from antdt.errors import ConfigError
from data.drift import Drift, mix_new_ids
from data.hashing import hash_arrow
from data.synth import (_CALIBRATION_STREAM, _ROWS_STREAM, SynthResult, _build_truth, _calibrate,
                        _next_day, _OracleDay, _rows, _sigmoid, _Truth, generate)

SMALL: dict[str, Any] = dict(rows=8_000, days=4, row_group_rows=1_000, files_per_day=2, num_dense=3,
             num_sparse=4, seed=2)


def file_bytes(result: SynthResult) -> dict[str, bytes]:
    root = Path(result.out)
    return {str(p.relative_to(root)): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "schema.yaml"}


def truths(days: int, drift: Drift, seed: int = 0, num_dense: int = 13, num_sparse: int = 26
           ) -> list[_Truth]:
    """The hidden model of each day, as :func:`data.synth.generate` derives them."""
    drift = drift.for_days(days)
    model = _build_truth(seed, num_dense, num_sparse, False, False, drift, days)
    _calibrate(model, np.random.default_rng([seed, _CALIBRATION_STREAM]))
    models = [model]
    for day in range(1, days):
        models.append(_next_day(models[-1], drift, seed, day))
    return models


def auc(logit: np.ndarray, labels: np.ndarray) -> float:
    oracle = _OracleDay()
    oracle.add(logit, labels)
    return float(oracle.summary()["auc"])


def day_vs_frozen(models: list[_Truth], day: int, rows: int) -> tuple[float, float]:
    """AUC on ``rows`` rows of ``day`` of that day's true logits and of day 0's true logits (the
    same rows, each id weighed as day 0's model weighs it)."""
    today = models[day]
    frozen = replace(models[0], sparse=[replace(s, cohorts=t.cohorts)
                                        for s, t in zip(models[0].sparse, today.sparse)])
    rng = np.random.default_rng([0, _ROWS_STREAM, day])
    state = rng.bit_generator.state
    _, terms = _rows(today, rng, rows)
    logit = today.logit(terms)
    labels = rng.random(rows) < _sigmoid(logit)
    rng.bit_generator.state = state
    _, frozen_terms = _rows(frozen, rng, rows)
    return auc(logit, labels), auc(frozen.logit(frozen_terms), labels)


@pytest.fixture(scope="module")
def drifting(tmp_path_factory: pytest.TempPathFactory) -> SynthResult:
    return generate(str(tmp_path_factory.mktemp("drift") / "out"), drift=Drift(), **SMALL)


def test_settings_are_checked_and_the_shift_day_defaults_to_the_middle() -> None:
    assert Drift().for_days(14).shift_day == 7
    assert Drift().for_days(1).shift_day == 1
    assert Drift(shift_day=3).for_days(14).shift_day == 3
    assert Drift(new_ids=0.1, id_half_life_days=1.0).cohort_shares(3) == \
        pytest.approx((0.025, 0.05, 0.1))
    assert Drift(new_ids=0.0).cohort_shares(3) == ()
    assert Drift(new_ids=0.05).cohort_size(10) == 1
    assert Drift(weekly=0.5).bias_offset(0) == 0.0
    assert Drift(weekly=0.5).bias_offset(7 // 4) == pytest.approx(0.5 * math.sin(2 * math.pi / 7))
    for bad, message in ((dict(rotate=-0.1), "rotate must be in"),
                         (dict(new_ids=0.6), "new_ids must be in"),
                         (dict(id_half_life_days=0.0), "id_half_life_days must be > 0"),
                         (dict(shift_day=0), "shift_day must be >= 1"),
                         (dict(shift=1.5), "shift must be in"),
                         (dict(new_ids=0.4, id_half_life_days=5.0), "once settled")):
        with pytest.raises(ConfigError, match=message):
            Drift(**bad)  # type: ignore[arg-type]


def test_new_ids_take_their_share_of_the_traffic() -> None:
    rng = np.random.default_rng(0)
    ranks = np.zeros(200_000, dtype=np.int64)
    mixed = mix_new_ids(rng, ranks, 100, 10, (0.05, 0.1), 1.1)
    assert mixed is ranks
    assert np.mean(ranks < 100) == pytest.approx(0.85, abs=0.005)
    assert np.mean((ranks >= 100) & (ranks < 110)) == pytest.approx(0.05, abs=0.003)
    assert np.mean(ranks >= 110) == pytest.approx(0.1, abs=0.003)
    assert ranks.max() < 120


def test_same_arguments_same_bytes_and_drift_changes_the_data(drifting: SynthResult,
                                                              tmp_path: Path) -> None:
    again = generate(str(tmp_path / "again"), drift=Drift(), **SMALL)
    assert file_bytes(again) == file_bytes(drifting)
    still = generate(str(tmp_path / "still"), **SMALL)
    assert file_bytes(still).keys() == file_bytes(drifting).keys()
    assert pq.read_table(still.files[0]).schema == pq.read_table(drifting.files[0]).schema
    assert not pq.read_table(still.files[0]).equals(pq.read_table(drifting.files[0]))


def test_the_oracle_records_the_drift(drifting: SynthResult) -> None:
    saved = json.loads((Path(drifting.out) / "oracle.json").read_text())
    assert saved == drifting.oracle
    assert saved["drift"] == {"rotate": 0.25, "new_ids": 0.05, "id_half_life_days": 3.0,
                              "weekly": 0.3, "shift_day": 2, "shift": 0.3}
    assert len(saved["per_day"]) == 4


def test_each_day_the_weights_turn_and_the_logit_keeps_its_scale() -> None:
    models = truths(6, Drift(rotate=0.3, shift=0.0, weekly=0.0), num_dense=13, num_sparse=6)
    day0 = np.concatenate([[d.weight for d in models[0].dense],
                           *(s.weights for s in models[0].sparse)])
    for day in range(1, 6):
        weights = np.concatenate([[d.weight for d in models[day].dense],
                                  *(s.weights for s in models[day].sparse)])
        previous = np.concatenate([[d.weight for d in models[day - 1].dense],
                                   *(s.weights for s in models[day - 1].sparse)])
        assert not np.allclose(weights, previous)
        assert np.corrcoef(weights, day0)[0, 1] == pytest.approx(math.cos(0.3) ** day, abs=0.02)
        assert weights.std() == pytest.approx(day0.std(), rel=0.05)
        _, terms = _rows(models[day], np.random.default_rng(day), 20_000)
        logit = models[day].logit(terms)
        assert logit.std() == pytest.approx(1.6, rel=0.05)
        assert _sigmoid(logit).mean() == pytest.approx(0.25, abs=0.01)


def test_a_frozen_model_decays_while_each_days_oracle_holds() -> None:
    models = truths(8, Drift())
    frozen_aucs = []
    for day in (1, 3, 6):
        oracle, frozen = day_vs_frozen(models, day, 20_000)
        assert 0.78 < oracle < 0.88
        frozen_aucs.append(frozen)
    assert frozen_aucs[0] > frozen_aucs[1] > frozen_aucs[2]
    assert oracle - frozen_aucs[2] > 0.1  # rotation over six days and the shift on day 4


def test_the_shift_day_drops_a_frozen_model_at_once() -> None:
    models = truths(6, Drift(rotate=0.0, new_ids=0.0, weekly=0.0, shift_day=3, shift=0.5))
    before = day_vs_frozen(models, 2, 20_000)
    after = day_vs_frozen(models, 3, 20_000)
    assert before[1] == pytest.approx(before[0], abs=0.005)
    assert after[1] < after[0] - 0.1


def test_new_ids_appear_every_day_without_sharing_a_bucket(drifting: SynthResult) -> None:
    by_day = [pq.read_table([f for f in drifting.files if f"date=2026-11-0{day + 1}" in f])
              for day in range(4)]
    for feature in drifting.schema.sparse:
        seen: set[int] = set()
        for day, table in enumerate(by_day):
            ids = set(pc.unique(table.column(feature.name).combine_chunks().drop_null())
                      .to_pylist())
            if day:
                assert ids - seen, (feature.name, day)
            seen |= ids
        buckets = hash_arrow(pc.unique(pq.read_table(drifting.files)
                                       .column(feature.name).combine_chunks().drop_null()),
                             feature.num_embeddings)
        assert len(np.unique(buckets)) == len(buckets) == len(seen), feature.name
    cardinalities = [10, 215, 4642, 100_000]
    assert [f.num_embeddings for f in drifting.schema.sparse] == \
        [2 * (c + 3 * math.ceil(0.05 * c)) for c in cardinalities]


def test_the_base_rate_follows_the_week(tmp_path: Path) -> None:
    result = generate(str(tmp_path / "week"), rows=7 * 12_000, days=7, row_group_rows=6_000,
                      files_per_day=1, num_dense=3, num_sparse=4,
                      drift=Drift(weekly=0.5, shift=0.0))
    ctr = np.array([d["ctr"] for d in result.oracle["per_day"].values()])
    week = np.sin(2 * np.pi * np.arange(7) / 7)
    assert np.corrcoef(ctr, week)[0, 1] > 0.9
    assert ctr.max() - ctr.min() > 0.1

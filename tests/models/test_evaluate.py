"""AUC and log loss against brute-force definitions (ties included), and evaluate()."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models.evaluate import auc, evaluate, logloss


def brute_auc(labels: list[float], scores: list[float]) -> float:
    """Over every (positive, negative) pair: 1 if the positive scores higher, 1/2 on a tie."""
    pos = [s for y, s in zip(labels, scores) if y == 1]
    neg = [s for y, s in zip(labels, scores) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def brute_logloss(labels: list[float], probs: list[float], eps: float) -> float:
    total = 0.0
    for y, p in zip(labels, probs):
        p = min(max(p, eps), 1 - eps)
        total -= y * math.log(p) + (1 - y) * math.log(1 - p)
    return total / len(labels)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 6)), min_size=2, max_size=40)
       .filter(lambda rows: len({y for y, _ in rows}) == 2))
def test_auc_matches_pairwise_count_with_ties(rows: list[tuple[int, int]]) -> None:
    # Scores from a handful of values, so ties (within and across classes) are frequent.
    labels = [float(y) for y, _ in rows]
    scores = [s / 6 for _, s in rows]
    got = auc(torch.tensor(labels), torch.tensor(scores, dtype=torch.float64))
    assert got == pytest.approx(brute_auc(labels, scores), abs=1e-12)


def test_auc_on_random_floats_and_numpy_input() -> None:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 300).astype(np.float32)
    scores = rng.random(300) + 0.3 * labels
    assert auc(labels, scores) == pytest.approx(brute_auc(labels.tolist(), scores.tolist()))
    assert auc(labels, -scores) == pytest.approx(1 - auc(labels, scores))


def test_auc_extremes_and_undefined() -> None:
    y = torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert auc(y, torch.tensor([0.1, 0.2, 0.3, 0.4])) == 1.0
    assert auc(y, torch.tensor([0.4, 0.3, 0.2, 0.1])) == 0.0
    assert auc(y, torch.full((4,), 0.7)) == 0.5
    assert math.isnan(auc(torch.ones(3), torch.rand(3)))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.floats(0.0, 1.0)), min_size=1, max_size=30))
def test_logloss_matches_definition(rows: list[tuple[int, float]]) -> None:
    labels = [float(y) for y, _ in rows]
    probs = [p for _, p in rows]
    got = logloss(torch.tensor(labels), torch.tensor(probs, dtype=torch.float64), eps=1e-7)
    assert got == pytest.approx(brute_logloss(labels, probs, 1e-7), rel=1e-9)


def test_logloss_clips_certain_mistakes() -> None:
    got = logloss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), eps=1e-7)
    assert got == pytest.approx(-math.log(1e-7), rel=1e-6)


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"found shapes \(3,\) and \(2,\)"):
        auc(torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match=r"1-d array"):
        logloss(torch.zeros(2, 1), torch.zeros(2, 1))


def _batch(labels: list[float]) -> Batch:
    n = len(labels)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["c"], values=torch.ones(n, dtype=torch.int64),
                                              lengths=torch.ones(n, dtype=torch.int64))
    return Batch(dense_features=torch.arange(n, dtype=torch.float32).unsqueeze(1),
                 sparse_features=kjt, labels=torch.tensor(labels))


def test_evaluate_scores_all_batches_together() -> None:
    # Each batch alone ranks perfectly, but across batches the second batch's negative (0.8)
    # outranks the first batch's positive (0.6): a per-batch average would say 1.0.
    batches = [_batch([0.0, 1.0]), _batch([0.0, 1.0])]
    probs = iter([torch.tensor([0.1, 0.6]), torch.tensor([0.8, 0.9])])
    result = evaluate(lambda batch: next(probs), batches)
    labels, scores = [0.0, 1.0, 0.0, 1.0], [0.1, 0.6, 0.8, 0.9]
    assert result["rows"] == 4
    assert result["auc"] == pytest.approx(brute_auc(labels, scores)) == 0.75
    assert result["logloss"] == pytest.approx(brute_logloss(labels, scores, 1e-7))


def test_evaluate_without_batches_is_an_error() -> None:
    with pytest.raises(ValueError, match="no batches"):
        evaluate(lambda batch: batch.labels, [])

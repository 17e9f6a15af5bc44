"""Evaluation metrics for click prediction: ROC AUC and log loss, vectorised (numpy, float64).

    >>> import torch
    >>> auc(torch.tensor([0., 0., 1., 1.]), torch.tensor([0.1, 0.4, 0.35, 0.8]))
    0.75
    >>> auc(torch.tensor([0., 1.]), torch.tensor([0.5, 0.5]))  # a tie counts one half
    0.5
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Iterable, TypedDict

import numpy as np
import torch
from torchrec.datasets.utils import Batch

logger = logging.getLogger(__name__)


class Metrics(TypedDict):
    """What :func:`evaluate` returns."""

    auc: float
    logloss: float
    rows: int


def _as_numpy(name: str, x: torch.Tensor | np.ndarray) -> np.ndarray:
    a = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name}: expected a 1-d array (one value per row), found shape {a.shape}")
    return a.astype(np.float64, copy=False)


def _pair(labels: torch.Tensor | np.ndarray,
          scores: torch.Tensor | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    y, s = _as_numpy("labels", labels), _as_numpy("scores", scores)
    if y.shape != s.shape:
        raise ValueError(f"labels and scores must have one value per row each; "
                         f"found shapes {y.shape} and {s.shape}")
    return y, s


def auc(labels: torch.Tensor | np.ndarray, scores: torch.Tensor | np.ndarray) -> float:
    """ROC AUC: the probability that a random positive scores above a random negative, ties
    counting one half (Mann–Whitney U from average ranks; O(n log n)).

    ``labels`` (n,) are 0/1 (``> 0.5`` is positive), ``scores`` (n,) any real numbers. Returns
    ``nan`` when one class is absent (AUC is undefined then, as a NaN metric rather than an error
    so that a small evaluation shard cannot stop a run).
    """
    y, s = _pair(labels, scores)
    positive = y > 0.5
    n_pos = int(positive.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        logger.warning("AUC undefined: %d positive and %d negative rows", n_pos, n_neg)
        return math.nan
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts, dtype=np.float64)  # 1-based rank of each distinct score's last row
    average_rank = ends - (counts - 1) / 2.0
    rank_sum = average_rank[inverse][positive].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def logloss(labels: torch.Tensor | np.ndarray, probs: torch.Tensor | np.ndarray,
            eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities ``probs`` (n,) against 0/1 ``labels`` (n,);
    ``probs`` are clipped to ``[eps, 1 - eps]`` so a confident mistake costs much, not infinity."""
    y, p = _pair(labels, probs)
    if y.size == 0:
        raise ValueError("logloss of zero rows is undefined")
    p = np.clip(p, eps, 1.0 - eps)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


def evaluate(predict: Callable[[Batch], torch.Tensor], batches: Iterable[Batch]) -> Metrics:
    """Run ``predict`` (a batch -> probabilities (B,), e.g. ``TrainStep.predict``) over
    ``batches`` and score all predictions together (AUC is not an average over batches)."""
    probs: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    for batch in batches:
        probs.append(predict(batch).detach().float().cpu())
        labels.append(batch.labels.detach().cpu())
    if not probs:
        raise ValueError("evaluate got no batches: there is nothing to score")
    y, p = torch.cat(labels), torch.cat(probs)
    return Metrics(auc=auc(y, p), logloss=logloss(y, p), rows=int(y.numel()))

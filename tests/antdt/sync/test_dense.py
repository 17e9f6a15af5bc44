"""Dense averaging: a group's mean is added as a difference, so progress made during the
exchange is kept and random pairs reach consensus on the mean."""

from __future__ import annotations

import random

import pytest
import torch

from antdt.sync import SyncError, average_dense


def test_average_keeps_local_progress_made_during_the_exchange() -> None:
    x = [torch.tensor([1.0, 1.0])]
    own = [t.clone() for t in x]
    x[0] += torch.tensor([0.5, 0.0])  # a training step during the exchange
    average_dense(x, own, [[torch.tensor([3.0, 5.0])]])
    assert x[0].tolist() == [2.5, 3.0]
    with pytest.raises(SyncError, match="does not match"):
        average_dense(x, own, [[torch.zeros(3)]])


def test_pairwise_random_groups_reach_consensus_and_keep_the_mean() -> None:
    rng = random.Random(3)
    replicas = [[torch.randn(4, 3, dtype=torch.float64)] for _ in range(6)]
    mean = torch.stack([r[0] for r in replicas]).mean(0)
    for _ in range(300):
        i, j = rng.sample(range(len(replicas)), 2)
        snaps = {k: [replicas[k][0].clone()] for k in (i, j)}
        average_dense(replicas[i], snaps[i], [snaps[j]])
        average_dense(replicas[j], snaps[j], [snaps[i]])
    spread = max((r[0] - mean).abs().max().item() for r in replicas)
    assert spread < 1e-6
    torch.testing.assert_close(torch.stack([r[0] for r in replicas]).mean(0), mean,
                               rtol=0, atol=1e-12)

"""Small replicas for the sync tests (``from sync_replicas import make_tables``): the float64
embedding tables and dense parameters of one seed, so that sums of deltas are exact."""

from __future__ import annotations

import torch

ROWS, DIM = 40, 3


def make_tables(seed: int = 0, rows: int = ROWS) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(rows, DIM, generator=gen, dtype=torch.float64),
            "b": torch.randn(rows // 2, DIM, generator=gen, dtype=torch.float64)}


def make_dense(seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 4, generator=gen, dtype=torch.float64),
            torch.randn(7, generator=gen, dtype=torch.float64)]

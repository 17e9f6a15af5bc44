"""RowSpace: the tables of one log are one space of rows, of one dim and dtype."""

from __future__ import annotations

import pytest
import torch

from antdt.sync import EmbeddingDeltaLog, SyncError


def test_tables_of_one_row_space_share_dim_and_dtype() -> None:
    with pytest.raises(SyncError, match="'b' is \\(2, torch.float64, cpu\\)"):
        EmbeddingDeltaLog({"a": torch.zeros(3, 4, dtype=torch.float64),
                           "b": torch.zeros(3, 2, dtype=torch.float64)})
    with pytest.raises(SyncError, match="'b' is \\(4, torch.float32, cpu\\)"):
        EmbeddingDeltaLog({"a": torch.zeros(3, 4, dtype=torch.float64),
                           "b": torch.zeros(3, 4)})

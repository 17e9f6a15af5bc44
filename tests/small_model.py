"""The small ranking model of the training-step tests (``from small_model import SCHEMA, SMALL``):
two single-valued features and a multi-valued one, tables of 50, 30 and 20 rows."""

from __future__ import annotations

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from data.schema import Schema
from models.config import ModelConfig

CPU = torch.device("cpu")
SCHEMA = Schema.from_dict({
    "label": "label",
    "dense": ["I1", "I2"],
    "sparse": [{"name": "C1", "num_embeddings": 50},
               {"name": "C2", "num_embeddings": 30},
               {"name": "tags", "num_embeddings": 20, "multi_valued": True}],
})
SMALL = ModelConfig(embedding_dim=8, dense_arch=(16, 8), over_arch=(16, 1))


def batches(n: int, seed: int = 0, rows: int = 16) -> list[Batch]:
    """Batches whose ids repeat within and across rows (``C1`` draws from 6 ids) and with empty
    ``tags`` bags."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tag_lengths = torch.randint(0, 4, (rows,), generator=g)
        values = torch.cat([torch.randint(0, 6, (rows,), generator=g),
                            torch.randint(0, 30, (rows,), generator=g),
                            torch.randint(0, 20, (int(tag_lengths.sum()),), generator=g)])
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=SCHEMA.sparse_names, values=values,
            lengths=torch.cat([torch.ones(2 * rows, dtype=torch.int64), tag_lengths]))
        out.append(Batch(dense_features=torch.rand(rows, 2, generator=g), sparse_features=kjt,
                         labels=torch.randint(0, 2, (rows,), generator=g).float()))
    return out

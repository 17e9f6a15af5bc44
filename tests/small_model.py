"""The small ranking model of the training-step tests (``from small_model import SCHEMA, SMALL``):
two single-valued features and a multi-valued one, tables of 50, 30 and 20 rows."""

from __future__ import annotations

import torch

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

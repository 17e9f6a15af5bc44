"""What the sync tests on a gen_cluster share (``from sync_cluster import service``): a small
model's float32 tables and dense parameters, the scheduler's SyncService, checks of a reply."""

from __future__ import annotations

import re
from typing import Any

import torch
from distributed import Scheduler

from antdt.sync.service import SyncService
from antdt.sync.wire import PLUGIN_NAME

ROWS, DIM = 30, 4
DENSE_SHAPES = ((6, 3), (3,))


def initial_tables(rows: int = ROWS) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"user": torch.randn(rows, DIM, generator=gen), "item": torch.randn(rows, DIM,
                                                                               generator=gen)}


def initial_dense() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=gen) for shape in DENSE_SHAPES]


def service(s: Scheduler) -> SyncService:
    plugin = s.plugins[PLUGIN_NAME]
    assert isinstance(plugin, SyncService)
    return plugin


def refused(reply: dict[str, Any], match: str) -> None:
    """A handler's error reply whose message matches ``match``."""
    assert reply["status"] == "error" and re.search(match, reply["message"]), reply


def ok(reply: dict[str, Any]) -> dict[str, Any]:
    assert reply["status"] == "OK", reply
    return reply

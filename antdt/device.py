"""The one place where antdt decides which torch device a process trains on."""

from __future__ import annotations

import os

import torch


def pick_device(prefer: str | None = None) -> torch.device:
    """Return ``cuda`` when this process has a usable GPU, ``cpu`` otherwise.

    ``prefer`` (or the ``ANTDT_DEVICE`` environment variable) forces a choice; asking for
    ``cuda`` on a machine without one raises instead of silently training on the CPU.

    >>> pick_device("cpu").type
    'cpu'
    """
    choice = prefer or os.environ.get("ANTDT_DEVICE") or "auto"
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {choice!r} was asked for, but torch sees no CUDA device here")
    return torch.device(choice)

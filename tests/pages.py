"""What backs a tensor's memory (``from pages import huge_bytes_at, kernel_collapses``): the
huge pages of this process's mappings, read from ``/proc/self/smaps``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from antdt.device import HUGE_PAGE, collapse_steps, huge_pages


def huge_bytes_at(address: int) -> int:
    """Bytes of huge pages in this process's mapping that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and ":" not in first:
            low, high = (int(part, 16) for part in first.split("-"))
            inside = low <= address < high
        elif inside and first == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


def on_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether the middle of ``tensor``'s storage lies in huge pages."""
    storage = tensor.untyped_storage()
    return huge_bytes_at(storage.data_ptr() + storage.nbytes() // 2) > 0


def kernel_collapses() -> bool:
    """Whether this kernel moves memory onto huge pages when asked (``MADV_COLLAPSE``: Linux 6.1
    and later, transparent huge pages not switched off)."""
    if not sys.platform.startswith("linux"):
        return False
    if "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        return False
    probe = torch.ones(3 * HUGE_PAGE // 4)
    huge_pages(probe, collapse=False)
    return sum(collapse_steps([probe])) > 0 and on_huge_pages(probe)

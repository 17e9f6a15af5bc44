"""What backs a tensor's memory (``from pages import huge_bytes_at, kernel_collapses``): the
huge pages of this process's mappings, read from ``/proc/self/smaps``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from antdt.device import HUGE_PAGE, collapse_steps, huge_pages


def _mapping_at(address: int) -> dict[str, list[str]]:
    """The fields of this process's mapping that holds ``address`` (``/proc/self/smaps``)."""
    fields: dict[str, list[str]] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first, *rest = line.split()
        if "-" in first and ":" not in first:
            if inside:
                break
            low, high = (int(part, 16) for part in first.split("-"))
            inside = low <= address < high
        elif inside:
            fields[first.rstrip(":")] = rest
    return fields


def huge_bytes_at(address: int) -> int:
    """Bytes of huge pages in this process's mapping that holds ``address``."""
    return int(_mapping_at(address).get("AnonHugePages", ["0"])[0]) * 1024


def marked_huge_at(address: int) -> bool:
    """Whether this process's mapping that holds ``address`` is marked for huge pages
    (``MADV_HUGEPAGE``: the flag ``hg``)."""
    return "hg" in _mapping_at(address).get("VmFlags", [])


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
    huge_pages(probe)
    return sum(collapse_steps([probe])) > 0 and on_huge_pages(probe)

"""antdt: straggler-tolerant distributed training on Dask (AntDT, arXiv 2404.09679)."""

from __future__ import annotations

__version__ = "0.1.0"

"""Zipf-like draws, numpy only: the synthetic data's categories (:mod:`data.synth`) and the ids
the sync benchmark trains on (``antdt bench sync``, which runs where pyarrow may be missing)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def zipf_ranks(rng: np.random.Generator, n: int, cardinality: int, exponent: float
               ) -> npt.NDArray[np.int64]:
    """``n`` frequency ranks in ``[0, cardinality)``, P(rank r) ~ (r + 1) ** -exponent.

    Inverse CDF of a power law on ``[1, cardinality + 1)``, floored, in float32 (vectorised
    ``exp``/``log``; its precision is ample for ranks below a few million).
    """
    top = np.float32(1.0 - float(cardinality + 1) ** (1.0 - exponent))
    u = rng.random(n, dtype=np.float32)
    u *= -top
    u += np.float32(1.0)
    np.log(u, out=u)
    u *= np.float32(1.0 / (1.0 - exponent))
    np.exp(u, out=u)
    return np.minimum(u.astype(np.int64) - 1, cardinality - 1)

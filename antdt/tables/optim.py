"""The sparse optimiser of a sharded table, applied where its rows live (:class:`RowOptimizer`).

In the local and sync modes FBGEMM's fused optimiser updates the embedding rows inside the
backward pass. With the tables on hosts, a trainer pushes the gradient of each row its batch
read (summed over the row's occurrences, as FBGEMM's *exact* backward sums it) and the host
applies the same update with this class. The formulas are those of FBGEMM's CPU kernels
(``fbgemm_gpu/codegen/genscript/optimizers.py``, ``split_weight_update_cpu``) with weight decay
0, the way TorchRec configures them: per row with gradient ``g`` (``D`` floats) and state ``s``::

    rowwise_adagrad  s += sum(g * g) / D          (one float per row: the mean square)
                     w -= g * (lr / (sqrt(s) + eps))
    adagrad          s += g * g                   (one float per element)
                     w -= lr * g / (sqrt(s) + eps)
    sgd              w -= lr * g                  (no state)

The new state enters the weight update (the state is added first). A host keeps the change
rather than the new values: :meth:`RowOptimizer.update` returns ``(delta_w, delta_state)``, which
a backup adds to its copy and a fenced trainer's entries subtract again.

    >>> opt = RowOptimizer("rowwise_adagrad", lr=0.5, eps=1e-8)
    >>> w, s = torch.zeros(1, 2), torch.zeros(1, opt.state_width(2))
    >>> dw, ds = opt.update(w, s, torch.tensor([[3.0, 4.0]]))
    >>> ds, dw                                  # mean square 12.5; step 0.5 / sqrt(12.5)
    (tensor([[12.5000]]), tensor([[-0.4243, -0.5657]]))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from antdt.errors import ConfigError

RowState = Literal["none", "row", "element"]

ROW_STATE: dict[str, RowState] = {
    "rowwise_adagrad": "row",
    "adagrad": "element",
    "sgd": "none",
}
"""The optimiser state kept per table row, by optimiser: row-wise Adagrad one float (the sum of
the mean squared gradients), Adagrad one per element (``embedding_dim`` floats), SGD none."""


@dataclass(frozen=True)
class RowOptimizer:
    """FBGEMM's fused sparse optimiser ``kind`` (a key of :data:`ROW_STATE`) with learning rate
    ``lr`` and Adagrad's denominator term ``eps`` (SGD ignores it), as a pure function of rows.

    Raises :class:`~antdt.errors.ConfigError` for an unknown ``kind`` or a rate that is not
    positive."""

    kind: str
    lr: float
    eps: float

    def __post_init__(self) -> None:
        if self.kind not in ROW_STATE:
            raise ConfigError(f"sparse optimizer: expected one of {list(ROW_STATE)} (the kinds "
                              f"a table host applies), found {self.kind!r}")
        if not self.lr > 0 or not self.eps > 0:
            raise ConfigError(f"sparse optimizer {self.kind}: expected lr > 0 and eps > 0, "
                              f"found lr={self.lr!r}, eps={self.eps!r}")

    def state_width(self, dim: int) -> int:
        """Floats of state per row of a table of ``dim`` columns: 0, 1 or ``dim``."""
        return {"none": 0, "row": 1, "element": dim}[ROW_STATE[self.kind]]

    @torch.no_grad()
    def update(self, weights: torch.Tensor, state: torch.Tensor,
               grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The change one step makes to ``n`` rows: ``weights`` ``(n, D)`` and ``state``
        ``(n, W)`` (:meth:`state_width`) their current values, ``grads`` ``(n, D)`` each row's
        gradient summed over its occurrences in the batch (one row once), all float32.

        Returns ``(delta_w (n, D), delta_state (n, W))``, float32, to add to the rows; the inputs
        are left as they are. Raises ``ValueError`` when the shapes do not fit together."""
        n, dim = weights.shape
        width = self.state_width(dim)
        if grads.shape != weights.shape or state.shape != (n, width):
            raise ValueError(f"{self.kind} update: expected weights and grads (n, D) and state "
                             f"(n, {width}) for D={dim}, found weights {tuple(weights.shape)}, "
                             f"state {tuple(state.shape)}, grads {tuple(grads.shape)}")
        if self.kind == "sgd":
            return grads * -self.lr, state.new_zeros(n, 0)
        if self.kind == "rowwise_adagrad":
            delta_state = grads.square().sum(dim=1, keepdim=True) / dim
            multiplier = self.lr / ((state + delta_state).sqrt() + self.eps)
            return -(grads * multiplier), delta_state
        delta_state = grads.square()
        return -(self.lr * grads / ((state + delta_state).sqrt() + self.eps)), delta_state

"""Dense parameters in the async mode: snapshots taken when an exchange starts and group
averaging that keeps the progress made meanwhile (``x += mean(snapshots) - own snapshot``).

Averaging is a consensus step: partial groups chosen by the scheduler still converge, and when
the whole group uses the same snapshots the sum of the group's parameters is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from antdt.errors import SyncError


def snapshot_dense(dense: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Detached copies of ``dense`` (same shapes) taken at the start of an exchange."""
    return [p.detach().clone() for p in dense]


def check_dense(own: Sequence[torch.Tensor], peer: Sequence[torch.Tensor]) -> None:
    """Raise :class:`SyncError` unless ``peer``'s snapshot has the shapes of ``own``."""
    if len(peer) != len(own) or any(a.shape != b.shape for a, b in zip(peer, own)):
        raise SyncError("dense snapshot does not match: expected shapes "
                        f"{[tuple(t.shape) for t in own]}, found "
                        f"{[tuple(t.shape) for t in peer]}")


def average_dense(dense: Sequence[torch.Tensor], own: Sequence[torch.Tensor],
                  peers: Sequence[Sequence[torch.Tensor]]) -> None:
    """Group averaging that keeps local progress: ``x += mean(own, *peers) - own`` in place.

    ``dense`` are the live parameters, ``own`` their snapshot from the exchange's start and
    ``peers`` the peers' snapshots of the same round (each the same shapes as ``dense``, on any
    device: received ones are in host memory). When the whole group uses the same snapshots the
    sum of the group's parameters is unchanged.
    """
    if not peers:
        return
    for peer in peers:
        check_dense(own, peer)
    scale = 1.0 / (len(peers) + 1)
    with torch.no_grad():
        for i, (param, mine) in enumerate(zip(dense, own)):
            total = mine.clone()
            for peer in peers:
                total += peer[i].to(mine.device)  # a peer's snapshot arrives in host memory
            param.add_(total.mul_(scale).sub_(mine))

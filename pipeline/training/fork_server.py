"""Imported first by the fork server of a command's LocalCluster
(:func:`pipeline.training.local_cluster.starting`), and by nothing else: the server leaves at
once when its command ends.

The server imported torch, TorchRec and MLflow for the workers it forks. When the command that
started it exits, it exits too, and tearing down an interpreter holding those modules takes
about a second and a half of a core, while it still holds the command's output (a pipe reading
the command's output waits for it). Its exit handlers run first, then it leaves without the
teardown. The process that imported this module is the only one it applies to: the workers it
forks keep their own exits.
"""

from __future__ import annotations

import atexit
import os

_SERVER = os.getpid()


def _leave() -> None:
    if os.getpid() == _SERVER:
        os._exit(0)


atexit.register(_leave)

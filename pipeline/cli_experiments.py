"""The ``antdt`` commands for experiments in MLflow: ``compare`` (runs side by side, data
included), ``promote`` (the registry's ``champion`` alias, moved only by a better score on the
same validation data) and ``sweep`` (a grid of trials on the Dask cluster, nested under one
run). Thin over :mod:`pipeline.compare`, :mod:`pipeline.registry` and :mod:`pipeline.sweep`,
which import MLflow only when a command runs.
"""

from __future__ import annotations

import click

EXPERIMENT_COMMANDS: list[click.Command] = []
"""The commands of this module, added to ``antdt`` by :mod:`pipeline.cli`."""

"""What a person sees on the terminal: our progress bars and summaries, our own warnings, and the
libraries' logs and warnings only when ``-v`` (info) or ``-vv`` (debug) asks for them.

A job runs in several processes (this one, a LocalCluster's scheduler and worker processes,
benchmark subprocesses), and each library speaks through its own channel, so being quiet takes
three things, all set up by :func:`configure` before any of them is imported or started:

* Python logging in this process: our packages' loggers (:data:`OWN_LOGGERS`) at WARNING, every
  other logger at ERROR (``distributed`` has a handler of its own and is set apart);
* Python warnings: ignored here, and in child processes through ``PYTHONWARNINGS``;
* the environment child processes inherit (:data:`QUIET_ENVIRONMENT`): MLflow's and torch's own
  log handlers, MLflow's download bars. A variable the user set is left as it is.

With ``-v`` the libraries speak at their own defaults and every logger here logs INFO (``-vv``:
DEBUG); worker processes log our packages at the same level through Dask's logging config.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import dask.config
from rich.console import Console, RenderableType
from rich.logging import RichHandler
from rich.measure import Measurement
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)

stderr = Console(stderr=True)

OWN_LOGGERS = ("antdt", "data", "models", "pipeline")
"""Our packages: their warnings are meant for the person running the job."""

QUIET_ENVIRONMENT = {
    # MLflow's own handler: no INFO lines about its database or experiments, no warning about
    # pickled models
    "MLFLOW_LOGGING_LEVEL": "ERROR",
    # no "Downloading artifacts" bars while a model is logged and its input example checked
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    # torch's own handler at ERROR: each process otherwise warns once about torch.fx tracing
    "TORCH_LOGS": "-all",
    # warnings in the processes we start (a LocalCluster's workers)
    "PYTHONWARNINGS": "ignore",
    # TorchRec's loggers in those workers (through Dask's logging config): its planner warns on
    # every sync rank about estimates of tensors it is not shown
    "DASK_LOGGING__TORCHREC": "error",
    # distributed's own loggers in the worker processes a LocalCluster forks from its server
    # (which imported distributed before any worker's settings reached it)
    "DASK_LOGGING__DISTRIBUTED": "error",
}


def configure(verbosity: int) -> None:
    """Set up logging, warnings and the child processes' environment for ``verbosity`` (0: our
    bars, summaries and warnings only; 1: INFO logs of every library; 2: DEBUG)."""
    if verbosity <= 0:
        for key, value in QUIET_ENVIRONMENT.items():
            os.environ.setdefault(key, value)
        warnings.simplefilter("ignore")
        root, own = logging.ERROR, logging.WARNING
    else:
        root = own = logging.INFO if verbosity == 1 else logging.DEBUG
        name = logging.getLevelName(own).lower()
        if verbosity >= 2:
            os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "DEBUG")
        for package in OWN_LOGGERS:  # worker processes read it through Dask's logging config
            os.environ.setdefault(f"DASK_LOGGING__{package.upper()}", name)
    # distributed sets its loggers' levels from Dask's config as it is imported, often after this
    dask.config.set({"logging.distributed": logging.getLevelName(root).lower()})
    logging.basicConfig(level=root, format="%(name)s: %(message)s", datefmt="[%X]",
                        handlers=[RichHandler(console=stderr, show_path=False)], force=True)
    for package in OWN_LOGGERS:
        logging.getLogger(package).setLevel(own)
    # distributed logs through a handler of its own; a LocalCluster passes its level to its
    # processes (see pipeline.training.cluster.connect)
    logging.getLogger("distributed").setLevel(root)


class _Bar:
    """One task of a rich progress display, as the :class:`~pipeline.job.report.ProgressSink` jobs
    report to."""

    def __init__(self, progress: Progress, task: TaskID) -> None:
        self._progress, self._task = progress, task

    def total(self, n: int) -> None:
        self._progress.update(self._task, total=n)

    def advance(self, n: int) -> None:
        self._progress.advance(self._task, n)


@contextmanager
def progress_bar(description: str, total: int | None = None, *, enabled: bool = True
                 ) -> Iterator[_Bar]:
    """A rich progress bar on stderr. Hidden when not ``enabled`` (``--json``)."""
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=stderr, disable=not enabled) as progress:
        yield _Bar(progress, progress.add_task(description, total=total))


def print_whole(*renderables: RenderableType) -> None:
    """Print ``renderables`` (tables, text) to stdout: on a terminal at its width; to a pipe or a
    file as wide as the widest of them needs, so that no table row or line is folded (rich
    would fold them at 80 columns there, and a job id split over two lines defeats ``grep``)."""
    console = Console()
    if not console.is_terminal:
        wide = console.options.update_width(10_000)
        console.width = max(console.width, *(Measurement.get(console, wide, r).maximum
                                             for r in renderables))
    for renderable in renderables:
        console.print(renderable)

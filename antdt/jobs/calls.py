"""How a job's master calls into its workers without blocking the scheduler's event loop: a task
on any worker (:func:`on_any_worker`), the result of a task pinned to a worker unless that
worker leaves first (:func:`result_on`), and waits that poll (:func:`until`)."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable
from typing import Any

from distributed import Client, Future, Scheduler
from distributed.client import FutureCancelledError
from distributed.metrics import time
from distributed.scheduler import KilledWorker

from antdt.errors import AntdtError, JobError

POLL_S = 0.05
"""How often a wait looks again (the runner's at its agents' futures between ticks: a job's end
waits at most this long to be noticed)."""


async def on_any_worker(client: Client, scheduler: Scheduler, function: Callable[..., Any],
                        *args: Any) -> tuple[Any, str | None]:
    """``function(*args)`` in a task on any worker (Dask retries it elsewhere if its worker
    dies): its result and the worker that holds it (None: unknown). Raises a
    :class:`JobError` when the workers running it kept dying or it failed."""
    future = client.submit(function, *args, pure=False)
    try:
        result = await future
        task = scheduler.tasks.get(future.key)
        holder = next(iter(task.who_has)).address if task is not None and task.who_has \
            else None
        return result, holder
    except KilledWorker as exc:
        raise JobError(f"the workers running {function.__name__} kept dying: {exc}") from exc
    except AntdtError:
        raise
    except Exception as exc:  # the application's error, raised on a worker
        raise JobError(f"{function.__name__} failed on a worker: {exc!r}") from exc
    finally:
        future.release()


async def result_on(client: Client, alive: Callable[[str], bool], future: Future, worker: str,
                    what: str) -> Any:
    """``future``'s result, or None if its (pinned) ``worker`` leaves the cluster
    (``alive(worker)`` turns false) before the result is fetched: a finished task's result
    lives on its worker, and once that worker is gone Dask would run the task again there,
    which never comes back (a wait for the result would never end). The task's error raises a
    :class:`JobError` saying ``what`` failed."""
    fetch = asyncio.ensure_future(_fetch(future))
    try:
        await until(lambda: fetch.done() or not alive(worker), math.inf)
        if not fetch.done():
            await client.cancel([future])  # ends the fetch
            with contextlib.suppress(FutureCancelledError):
                await fetch
            return None
        return fetch.result()
    except KilledWorker:
        return None
    except AntdtError:
        raise
    except Exception as exc:  # the application's error, raised on the worker
        raise JobError(f"{what} failed on {worker}: {exc!r}") from exc
    finally:
        future.release()


async def until(condition: Callable[[], bool], timeout_s: float) -> None:
    """Return once ``condition()`` holds (checked every :data:`POLL_S`) or after
    ``timeout_s``."""
    deadline = time() + timeout_s
    while not condition() and time() < deadline:
        await asyncio.sleep(min(POLL_S, max(0.0, deadline - time())))


async def _fetch(future: Future) -> Any:
    return await future

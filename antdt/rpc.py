"""Scheduler handlers that never raise into the scheduler: a refused call is an error reply.

Every ``antdt_*`` handler (sharding, controller, sync, jobs) answers a plain dict,
``{"status": "OK", ...}`` or ``{"status": "error", "message": ...}``: a malformed call (wrong
types, an unknown job, a stale token) changes nothing, names what was expected and what was
found, and leaves the other jobs alone. :func:`handler` turns the domain error a handler raises
into that reply; :func:`ok` turns it back into the error on the caller's side.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec

from antdt.errors import AntdtError, LedgerError

logger = logging.getLogger(__name__)

MAX_NAME = 256
"""Longest job, worker or path name a handler accepts."""

Reply = dict[str, Any]
P = ParamSpec("P")


def handler(fn: Callable[P, Awaitable[Reply]]) -> Callable[P, Awaitable[Reply]]:
    """Turn a call that does not fit the handler's signature (a missing or unknown argument)
    and an :class:`~antdt.errors.AntdtError` it raises (a call it refuses) into an error reply
    (the caller sees ``{"status": "error", "message": ...}``); anything else is a bug and
    propagates."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> Reply:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as e:
            return {"status": "error", "message": f"{fn.__name__}: {e}"}
        try:
            return await fn(*args, **kwargs)
        except AntdtError as e:
            logger.info("%s refused: %s", fn.__name__, e)
            return {"status": "error", "message": str(e)}

    return wrapper


def name(what: str, value: object, error: type[AntdtError] = LedgerError) -> str:
    """``value`` as a name (a job, a worker, a path) of 1 to :data:`MAX_NAME` characters, else
    ``error``."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME:
        raise error(f"{what} must be a str of 1 to {MAX_NAME} characters, found "
                          f"{str(value)[:80]!r} ({type(value).__name__})")
    return value


def integer(what: str, value: object, low: int = 0, high: int | None = None, *,
            optional: bool = False, error: type[AntdtError] = LedgerError) -> Any:
    """``value`` as an int in ``[low, high]`` (None too when ``optional``), else ``error``;
    bools are refused."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low \
            or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise error(f"{what} must be an int {bound}{' or None' if optional else ''}, found "
                    f"{repr(value)[:80]}")
    return value


def seconds(what: str, value: object, high: float, *, optional: bool = False,
            error: type[AntdtError] = LedgerError) -> Any:
    """``value`` as a number of seconds in ``[0, high]`` (None too when ``optional``), else
    ``error``; bools, NaN and infinities are refused."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or not 0 <= value <= high:
        raise error(f"{what} must be a number of seconds in [0, {high:g}]"
                    f"{' or None' if optional else ''}, found {repr(value)[:80]}")
    return float(value)


def ok(reply: Reply, error: type[AntdtError] = LedgerError) -> Reply:
    """On the caller's side: ``reply`` if it is OK, else its message as ``error``."""
    if reply.get("status") != "OK":
        raise error(str(reply.get("message", reply)))
    return reply

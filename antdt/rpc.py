"""Scheduler handlers that never raise into the scheduler: a refused call is an error reply.

Every ``antdt_*`` handler of the sharding service and the controller answers a plain dict,
``{"status": "OK", ...}`` or ``{"status": "error", "message": ...}``: a malformed call (wrong
types, an unknown job, a stale token) changes nothing, names what was expected and what was
found, and leaves the other jobs alone. :func:`handler` turns the domain error a handler raises
into that reply; :func:`ok` turns it back into the error on the caller's side.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec

from antdt.errors import LedgerError

logger = logging.getLogger(__name__)

MAX_NAME = 256
"""Longest job, worker or path name a handler accepts."""

Reply = dict[str, Any]
P = ParamSpec("P")


def handler(fn: Callable[P, Awaitable[Reply]]) -> Callable[P, Awaitable[Reply]]:
    """Turn a :class:`~antdt.errors.LedgerError` raised by a handler into an error reply (the
    caller sees ``{"status": "error", "message": ...}``); anything else is a bug and propagates."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> Reply:
        try:
            return await fn(*args, **kwargs)
        except LedgerError as e:
            logger.info("%s refused: %s", fn.__name__, e)
            return {"status": "error", "message": str(e)}

    return wrapper


def name(what: str, value: object) -> str:
    """``value`` as a name (a job, a worker, a path) of 1 to :data:`MAX_NAME` characters."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME:
        raise LedgerError(f"{what} must be a str of 1 to {MAX_NAME} characters, found "
                          f"{str(value)[:80]!r} ({type(value).__name__})")
    return value


def ok(reply: Reply) -> Reply:
    """On the caller's side: ``reply`` if it is OK, else its message as a
    :class:`~antdt.errors.LedgerError`."""
    if reply.get("status") != "OK":
        raise LedgerError(str(reply.get("message", reply)))
    return reply

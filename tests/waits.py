"""Bounds on the blocking calls of tests (``from waits import bounded``): a deadlock fails the
test with every thread's stack instead of hanging. A test waits for the event it needs (a
condition polled by :meth:`Bounded.until`, a call's return), never for a duration; the bound only
catches a hang, so it is generous (minutes on a loaded machine). The suite-wide pytest-timeout
(signal method) is the last resort: it fails the one test that hung."""

from __future__ import annotations

import asyncio
import inspect
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import pytest
from distributed import Client, Future, wait

T = TypeVar("T")

CALL_TIMEOUT_S = 240.0
"""A bounded call's default limit: a job of the test suite takes seconds to a minute."""

WAIT_S = 120.0
"""A wait's default bound: an event of the suite's comes within seconds; two minutes only
catch a hang, even with the machine's other core busy."""


def thread_stacks() -> str:
    """Every thread of this process with its stack, as text."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return "\n".join(f"--- thread {names.get(ident, ident)}:\n"
                     f"{''.join(traceback.format_stack(frame))}"
                     for ident, frame in sys._current_frames().items())


class Call(Generic[T]):
    """``fn(*args, **kwargs)`` running in a daemon thread from construction on."""

    def __init__(self, timeout_s: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> None:
        self.timeout_s = timeout_s
        self._name = getattr(fn, "__name__", repr(fn))
        self._outcome: list[Any] = []
        self._thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True,
                                        name=f"bounded-{self._name}")
        self._thread.start()

    def _run(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            self._outcome.append(("value", fn(*args, **kwargs)))
        except BaseException as exc:  # handed to the test thread by result()
            self._outcome.append(("error", exc))

    def done(self) -> bool:
        return not self._thread.is_alive()

    def failed(self) -> bool:
        """Whether the call ended with an exception."""
        return self.done() and self._outcome[0][0] == "error"

    def result(self) -> T:
        """The call's value (its exception is raised); fails with every thread's stack when it
        has not returned within the limit."""
        self._thread.join(self.timeout_s)
        if self._thread.is_alive():
            pytest.fail(f"{self._name} did not return within {self.timeout_s:g}s (a deadlock?)\n"
                        f"{thread_stacks()}", pytrace=False)
        kind, value = self._outcome[0]
        if kind == "error":
            raise value
        result: T = value
        return result


class Bounded:
    """Blocking calls with a time limit. A wait (:meth:`until`) ends at once, with the call's
    exception, when a call started by :meth:`start` (which the awaited event depends on) failed:
    the test reports why the job failed, not that an event never came."""

    def __init__(self) -> None:
        self._started: list[Call[Any]] = []

    def call(self, fn: Callable[..., T], *args: Any, timeout_s: float = CALL_TIMEOUT_S,
             **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, failing after ``timeout_s`` with every thread's stack."""
        return Call(timeout_s, fn, *args, **kwargs).result()

    def start(self, fn: Callable[..., T], *args: Any, timeout_s: float = CALL_TIMEOUT_S,
              **kwargs: Any) -> Call[T]:
        """``fn(*args, **kwargs)`` started in a thread; ``.result()`` waits for it, bounded."""
        call = Call(timeout_s, fn, *args, **kwargs)
        self._started.append(call)
        return call

    def forget(self) -> None:
        """Drop the started calls (at a test's end: a call a failed test left running does not
        end the next test's waits)."""
        self._started = []

    def gather(self, client: Client, futures: Sequence[Future],
               timeout_s: float = WAIT_S) -> list[Any]:
        """The futures' results, failing after ``timeout_s`` with every thread's stack (the
        workers' too, when they run in this process)."""
        try:
            wait(list(futures), timeout=timeout_s)
        except TimeoutError:
            pytest.fail(f"{len(futures)} task(s) did not finish within {timeout_s:g}s\n"
                        f"{thread_stacks()}", pytrace=False)
        return list(client.gather(list(futures)))

    def result(self, future: Future, timeout_s: float = WAIT_S) -> Any:
        """One future's result, bounded like :meth:`gather`."""
        return self.gather(future.client, [future], timeout_s)[0]

    def until(self, condition: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
        """Poll ``condition`` until it returns something truthy, and return that; fail after
        ``timeout_s`` naming ``what`` was awaited."""
        deadline = time.monotonic() + timeout_s
        while not (value := condition()):
            for call in self._started:
                if call.failed():
                    call.result()
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: not reached within {timeout_s:g}s\n{thread_stacks()}",
                            pytrace=False)
            time.sleep(0.02)
        return value


bounded = Bounded()


async def until(check: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    """In a coroutine (a ``gen_cluster`` test): poll ``check`` (its value, or the value it
    returns to await) until it is truthy, and return that; fail after ``timeout_s`` naming
    ``what`` was awaited."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)

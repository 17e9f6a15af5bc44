"""Overlap reading with training: run an iterator a few items ahead in a background thread.

Reading a batch (pyarrow decode, numpy hashing) releases the GIL for most of its time, so one
producer thread keeps the training loop fed while the training thread owns the compute.
"""

from __future__ import annotations

import queue
import threading
from types import TracebackType
from typing import Generic, Iterable, Iterator, TypeVar

T = TypeVar("T")

_POLL_S = 0.1


class _End:
    """Marks the end of the source; carries the producer's exception, if any."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class Prefetcher(Generic[T], Iterator[T]):
    """Iterate over ``source`` in a daemon thread, at most ``depth`` items ahead.

    An exception raised by the source is re-raised in the consumer at the point where the item
    would have been. ``close()`` (or leaving the ``with`` block) stops the producer promptly,
    even when the consumer stops early.

    >>> with Prefetcher(range(5), depth=2) as items:
    ...     list(items)
    [0, 1, 2, 3, 4]
    """

    def __init__(self, source: Iterable[T], depth: int = 2, name: str = "antdt-prefetch") -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, found {depth}")
        self._queue: queue.Queue[T | _End] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._produce, args=(iter(source),), name=name,
                                        daemon=True)
        self._thread.start()

    def _produce(self, source: Iterator[T]) -> None:
        end = _End()
        try:
            for item in source:
                if not self._offer(item):
                    return
        except BaseException as exc:  # handed to the consumer, re-raised there
            end = _End(exc)
        self._offer(end)

    def _offer(self, item: T | _End) -> bool:
        """Put ``item`` unless the consumer closed us; False when closed."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if isinstance(item, _End):
            self._done = True
            self._thread.join()
            if item.error is not None:
                raise item.error
            raise StopIteration
        return item

    def close(self) -> None:
        self._stop.set()
        self._done = True
        self._thread.join()

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

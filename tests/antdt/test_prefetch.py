"""Prefetcher: order kept, errors re-raised in the consumer, early close stops the producer."""

from __future__ import annotations

import threading
from typing import Iterator

import pytest

from antdt.prefetch import Prefetcher


def test_items_arrive_in_order() -> None:
    with Prefetcher(iter(range(100)), depth=3) as items:
        assert list(items) == list(range(100))


def test_source_error_is_raised_where_the_item_would_be() -> None:
    def source() -> Iterator[int]:
        yield 1
        yield 2
        raise ValueError("row group 3 is truncated")

    seen = []
    with pytest.raises(ValueError, match="truncated"), Prefetcher(source()) as items:
        for item in items:
            seen.append(item)
    assert seen == [1, 2]


def test_close_stops_an_endless_producer() -> None:
    produced = threading.Event()

    def endless() -> Iterator[int]:
        n = 0
        while True:
            produced.set()
            yield n
            n += 1

    prefetcher = Prefetcher(endless(), depth=2)
    assert next(prefetcher) == 0
    prefetcher.close()
    assert produced.is_set()
    assert not prefetcher._thread.is_alive()
    with pytest.raises(StopIteration):
        next(prefetcher)


def test_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="depth must be >= 1"):
        Prefetcher([], depth=0)

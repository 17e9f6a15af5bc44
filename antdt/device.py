"""The one place where antdt decides how a training process runs: its torch device, its torch
threads, its memory allocator, the pages behind its embedding tables and its garbage
collector."""

from __future__ import annotations

import ctypes
import errno
import functools
import gc
import logging
import os
import sys
import threading
from collections.abc import Iterable, Iterator

import torch

logger = logging.getLogger(__name__)

# glibc's mallopt(3) parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 * 1024 * 1024
"""Allocations below this come from the heap, not from a fresh mmap: glibc's own dynamic
threshold stops at this size (its maximum on 64-bit), and a training step's tensors (a batch's
pooled embeddings and activations, several MB each) sit under it."""

# madvise(2) advice values (linux/mman.h).
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1+: huge pages now, not when khugepaged gets to the range
_COLLAPSE_TRIES = 3
"""Asks of one collapse step the kernel refuses for a moment (``EAGAIN``: "the caller may
retry", says madvise(2))."""

HUGE_PAGE = 2 * 1024 * 1024
"""The transparent huge page size of x86-64 and of most arm64 kernels."""

TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
"""Free memory glibc keeps at the top of the heap before returning it to the system (glibc's
dynamic rule: twice the mmap threshold)."""


def pick_device(prefer: str | None = None) -> torch.device:
    """Return ``cuda`` when this process has a usable GPU, ``cpu`` otherwise.

    ``prefer`` (or the ``ANTDT_DEVICE`` environment variable) forces a choice; asking for
    ``cuda`` on a machine without one raises instead of silently training on the CPU.

    >>> pick_device("cpu").type
    'cpu'
    """
    choice = prefer or os.environ.get("ANTDT_DEVICE") or "auto"
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {choice!r} was asked for, but torch sees no CUDA device here")
    return torch.device(choice)


GIL_SWITCH_S = 0.0005
"""The interpreter's switch interval in a training process (:func:`sys.setswitchinterval`;
Python's default is 5 ms). A Dask worker's event loop and sync threads take the GIL for short
bursts between the training thread's steps; at the default, a thread that wants it back waits
up to 5 ms for the holder to be asked to let go, a few times per sync round. On 2 cores a
2-worker job trained 1.5-2.3% faster at 0.5 ms (3 interleaved pairs; a lone worker, whose event
loop has the idle core, the same within noise)."""


def prepare_process(threads: int) -> None:
    """Set this process up to train: ``threads`` torch threads, a heap that keeps the
    training step's buffers (:func:`tune_allocator`) and a short GIL switch interval
    (:data:`GIL_SWITCH_S`)."""
    torch.set_num_threads(threads)
    tune_allocator()
    sys.setswitchinterval(GIL_SWITCH_S)


@functools.cache
def tune_allocator() -> bool:
    """Make glibc serve the training step's multi-MB tensors from the heap; False where the C
    library is not glibc (nothing to do there).

    A Dask nanny starts its worker with ``MALLOC_TRIM_THRESHOLD_=65536`` (Dask's
    ``distributed.nanny.pre-spawn-environ``), and glibc then switches off its dynamic mmap
    threshold: every tensor over 128 KB is a fresh mmap, zeroed page by page by the kernel, and
    unmapped when freed. That halves a DLRM step on the CPU (66k samples/s → 33k, most of the
    difference in system time). Setting both thresholds here undoes it in any process, however
    it was started; it is what glibc's dynamic threshold would settle on.
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    ok = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
          and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
    if not ok:
        logger.warning("mallopt refused antdt's heap thresholds; training steps may be slower")
    return ok


def huge_pages(tensor: torch.Tensor) -> int:
    """Mark the host memory of ``tensor``'s storage for transparent huge pages (2 MB) where the
    kernel allows (``MADV_HUGEPAGE``: the kernel keeps the range huge once it is); return the
    bytes marked (0: not on Linux, not in host memory, under one huge page, or refused).

    Embedding tables are tens of MB read and written a row at a time: with 4 KB pages nearly
    every row of a sync round's gathers and scatters (tens of thousands per round) misses the
    TLB. With huge pages a 2-worker job's round publishes and merges about 15% faster. Marking
    moves nothing: :func:`collapse_steps` does, a piece at a time.
    """
    span = _huge_span(tensor)
    if span is None:
        return 0
    start, end = span
    return end - start if _madvise(start, end - start, _MADV_HUGEPAGE) == 0 else 0


def collapse_steps(tensors: Iterable[torch.Tensor], step: int = 2 * HUGE_PAGE) -> Iterator[int]:
    """Move the host memory of ``tensors`` (each storage once) onto huge pages ``step`` bytes
    at a time (``MADV_COLLAPSE``), yielding the bytes of each step the kernel took, so that a
    thread can do it between other work. A step refused for a moment (``EAGAIN``: a page
    locked or in flight) is asked again up to ``_COLLAPSE_TRIES`` times; one refused for want
    of a free huge page (``ENOMEM``: memory fragmented) is passed over and stays on 4 KB pages;
    where the kernel cannot collapse at all (before Linux 6.1, or huge pages off) it stops.

    Moving pages is copying them into fresh memory: on a VM, where fresh memory is costly to
    touch, it took 0.1–0.25 s for one worker's tables and sync base, time that every start of
    a job would otherwise pay before the first batch."""
    storages = {t.untyped_storage().data_ptr(): t for t in tensors}
    for tensor in storages.values():
        span = _huge_span(tensor)
        if span is None:
            continue
        for start in range(span[0], span[1], step):
            length = min(step, span[1] - start)
            for _ in range(_COLLAPSE_TRIES):
                error = _madvise(start, length, _MADV_COLLAPSE)
                if error != errno.EAGAIN:
                    break
            if error == 0:
                yield length
            elif error not in (errno.EAGAIN, errno.ENOMEM):
                return


def _huge_span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The whole huge pages inside ``tensor``'s host storage, as (start, end) addresses; None
    where there are none (on another device, another system, or under one huge page)."""
    if tensor.device.type != "cpu" or not sys.platform.startswith("linux"):
        return None
    storage = tensor.untyped_storage()
    start = -(-storage.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (storage.data_ptr() + storage.nbytes()) // HUGE_PAGE * HUGE_PAGE
    return (start, end) if end > start else None


def _madvise(start: int, length: int, advice: int) -> int:
    """``madvise(2)`` over [start, start + length): 0, or the errno of its refusal."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(start, length, advice) == 0:
        return 0
    error = ctypes.get_errno()
    name = "MADV_HUGEPAGE" if advice == _MADV_HUGEPAGE else "MADV_COLLAPSE"
    logger.debug("madvise(%s) refused: %s", name, os.strerror(error))
    return error


class FrozenHeap:
    """``with FROZEN_HEAP:`` while training: the objects alive when a training loop of this
    process starts (an agent's, the local mode's, a benchmark's bare trainer; on the scheduler,
    a job's master), its imports and its model, are left out of the garbage collector's scans
    until the last one ends (:func:`gc.freeze`). A Dask worker holds about 750,000 of them
    (torch, Dask, MLflow, the model); a full collection over them holds the GIL for about half
    a second, which stops the training thread, the worker's event loop and, through the sync
    rounds, its partners. Only cyclic garbage that exists at the start waits for the end to be
    collected."""

    def __init__(self) -> None:
        self._training = 0
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        with self._lock:
            self._training += 1
            gc.freeze()

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._training -= 1
            if not self._training:
                gc.unfreeze()

    def collect(self) -> None:
        """A full collection now, the frozen objects included, which are frozen again while a
        training loop runs: for a process about to allocate a model its memory is sized for
        (a synchronous rank forming its group again), whose last model may be cyclic garbage
        that a freeze kept from every collection since (a broken collective's traceback holds
        the frames that held it). Holds the GIL for about half a second."""
        with self._lock:
            gc.unfreeze()
            gc.collect()
            if self._training:
                gc.freeze()

    def settle(self) -> None:
        """Freeze what this process holds now, ahead of its training loop (a worker whose
        job's imports are done): a full collection due before the loop starts then scans only
        what came after. Over the whole heap it would stop the worker's event loop for half a
        second as the agent task arrives, and with it the job's start. The end of the next
        training loop here unfreezes these objects with its own (none following: they stay
        frozen, and the garbage among them uncollected)."""
        with self._lock:
            gc.freeze()


FROZEN_HEAP = FrozenHeap()
"""This process's :class:`FrozenHeap`."""

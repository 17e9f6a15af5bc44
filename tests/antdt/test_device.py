"""The process set-up of a training process: its device and its memory allocator."""

from __future__ import annotations

import os
import gc
import subprocess
import sys
import textwrap
import weakref

import dask.config
import distributed  # importing it puts its defaults (distributed.nanny.*) in dask.config
import pytest
import torch

from antdt.device import (GIL_SWITCH_S, HUGE_PAGE, FrozenHeap, collapse_steps, huge_pages,
                          pick_device)
from pages import huge_bytes_at, kernel_collapses, marked_huge_at

# Run in a fresh interpreter: whether an 8 MB malloc is served by a fresh mmap (glibc counts
# those in mallinfo2().hblks) before and after tune_allocator().
PROBE = textwrap.dedent("""
    import ctypes
    from antdt.device import tune_allocator

    libc = ctypes.CDLL(None)
    fields = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
              "uordblks", "fordblks", "keepcost")
    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in fields]
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def mmapped(size):
        before = libc.mallinfo2().hblks
        buffer = libc.malloc(size)
        during = libc.mallinfo2().hblks
        libc.free(buffer)
        return during - before

    print(mmapped(8 << 20), tune_allocator(), mmapped(8 << 20))
""")


def test_pick_device_honours_a_choice_and_refuses_a_missing_gpu() -> None:
    assert pick_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            pick_device("cuda")


def test_a_training_process_hands_the_gil_over_sooner() -> None:
    # a fresh interpreter: this one's agents (in-process workers) may have prepared it already
    probe = ("import sys; from antdt.device import prepare_process; "
             "before = sys.getswitchinterval(); prepare_process(1); "
             "print(before, sys.getswitchinterval())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.split()
    assert [float(x) for x in out] == [0.005, GIL_SWITCH_S] and GIL_SWITCH_S < 0.005


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator only")
def test_tune_allocator_undoes_the_dask_nannys_malloc_trim_threshold() -> None:
    # A nanny starts its worker with this environment; glibc then mmaps every buffer over
    # 128 KB afresh, which halved a DLRM training step.
    nanny_environ = dask.config.get("distributed.nanny.pre-spawn-environ")
    env = {**os.environ, **{k: str(v) for k, v in nanny_environ.items()}}
    assert "MALLOC_TRIM_THRESHOLD_" in env
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["1", "True", "0"], out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux madvise(2) only")
def test_huge_pages_marks_the_whole_huge_pages_inside_a_table() -> None:
    table = torch.randn((6 << 20) // 4)  # 6 MB: at least two whole huge pages inside
    asked = huge_pages(table)
    assert asked >= 2 * HUGE_PAGE and asked % HUGE_PAGE == 0
    assert marked_huge_at(table.data_ptr() + table.nbytes // 2)
    small = torch.zeros(1000)
    assert huge_pages(small) == 0  # under one huge page: nothing to ask
    assert not marked_huge_at(small.data_ptr())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux madvise(2) only")
def test_marked_memory_moves_onto_huge_pages_a_step_at_a_time() -> None:
    table = torch.randn((9 << 20) // 4)  # 9 MB: at least four whole huge pages inside
    values = table.clone()
    asked = huge_pages(table)
    moved = list(collapse_steps([table, table[100:], torch.zeros(1000)], step=HUGE_PAGE))
    assert all(step == HUGE_PAGE for step in moved)
    assert sum(moved) <= asked  # one storage once, whole huge pages only
    assert torch.equal(table, values)  # the values survive the move to huge pages
    if not moved and kernel_collapses():  # a long run of tests may leave no free huge page
        pytest.skip("the kernel had no free huge page for the table")
    assert huge_bytes_at(table.data_ptr() + table.nbytes // 2) >= sum(moved)


class _Node:
    """An object in a reference cycle (only a full collection frees it)."""

    def __init__(self) -> None:
        self.me = self


def test_a_frozen_heaps_collection_frees_cyclic_garbage_a_freeze_kept() -> None:
    """A cycle left over from before a training loop is frozen with the heap and survives
    gc.collect(); FrozenHeap.collect frees it and freezes the rest again while training."""
    heap = FrozenHeap()
    try:
        node = _Node()
        gone = weakref.ref(node)
        del node
        with heap:  # the loop's start freezes the garbage with everything else
            gc.collect()
            assert gone() is not None
            heap.collect()
            assert gone() is None
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()

"""The process set-up of a training process: its device and its memory allocator."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import dask.config
import pytest
import torch

from antdt.device import pick_device

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

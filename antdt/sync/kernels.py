"""A round's replica work on the CPU in one pass over its rows: the cut and the merge of
:class:`~antdt.sync.EmbeddingDeltaLog` as numba kernels, and the rows a mask marks.

A round's cut reads each touched row of the tables and of the base and writes the base and the
entry; its merge adds a peer's rows to the tables and to the base. As torch index kernels that
is four to six passes over rows scattered through tens of MB, each pass paying every row's cache
and TLB misses again; a loop that visits each row once pays them once (a merge of 34k rows of 16
floats in 40 MB tables: 2.9 ms against 5.6 ms for two ``index_add_``; an exact cut 2.5 ms
against 5.2 ms).

Each kernel computes bit for bit what the torch operations it replaces compute: the same IEEE
float32 subtractions and additions, and bfloat16 rounding to nearest even as torch rounds (a NaN
becomes ``0xFFFF``, as in torch's vectorized conversion). They release the GIL, so the training
thread goes on while a merge runs, and they run on the calling thread alone. They do not check
their ids: callers pass rows inside the tables (a mask's true rows, or an entry that
:meth:`EmbeddingDeltaLog.apply` checked).

:func:`host_rows` says which tables they serve: float32 in host memory, laid end to end (one
``(rows, dim)`` array), with float32 or bfloat16 deltas. Other tables (a GPU's, tables apart,
float16 deltas) keep torch's operations. Compiled code is cached beside this module, so a process
compiles nothing that an earlier one compiled.

The rows a round visits are scattered through tables far larger than the caches, so each row's
lines come from memory, and a row's work (16 roundings, in the default model) is long enough that
the CPU runs only a few rows ahead on its own: the loop waited for one row's lines after another.
Each kernel therefore asks for the lines of the row :data:`PREFETCH_ROWS` ahead while it works on
the current one, so that they arrive meanwhile. On 35,800 rows of 16 floats in 40 MB tables that
halves both kernels (a cut 1.1-1.4 against 2.0-2.4 ms, a merge 1.0 against 1.9 ms); the whole
cut and merge of a round, as ``antdt bench sync`` times them, take a fifth less. The four lines
that ask are written out in each kernel: moved into a helper function (which numba did not
inline, even with ``inline="always"``) they made the kernels slower than asking for nothing.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

_ROWS = "float32[:, ::1]"
_BITS = "uint16[:, ::1]"
_MASK = "boolean[::1]"
_IDS = "int64[::1]"
_WORDS = "uint64[::1]"

# The cut's and the merge's delta dtypes the kernels serve, with the tables in float32.
KERNEL_DELTAS = (torch.float32, torch.bfloat16)

PREFETCH_ROWS = 32
"""How many rows ahead a kernel asks for the cache lines of the row it will reach."""


@intrinsic
def _prefetch(typingctx, rows, row):  # type: ignore[no-untyped-def]
    """``_prefetch(rows, row)`` in a kernel: ask the CPU to bring the cache lines holding the
    first and the last value of ``rows[row]`` (a C-contiguous 2-D array) to its caches, to be
    written: the whole row up to 32 floats, the CPU's own prefetcher follows longer ones. A hint
    (``llvm.prefetch``): it never faults and computes nothing."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        array = context.make_array(signature.args[0])(context, builder, args[0])
        shape = cgutils.unpack_tuple(builder, array.shape)
        strides = cgutils.unpack_tuple(builder, array.strides)
        byte = ir.IntType(8).as_pointer()
        word = ir.IntType(32)
        function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte, word, word, word]),
            "llvm.prefetch.p0i8")
        last = builder.sub(shape[1], ir.Constant(shape[1].type, 1))
        for column in (ir.Constant(shape[1].type, 0), last):
            pointer = cgutils.get_item_pointer2(context, builder, array.data, shape, strides,
                                                signature.args[0].layout, [args[1], column],
                                                wraparound=False)
            # (address, to write, keep in every cache level, data rather than instructions)
            builder.call(function, [builder.bitcast(pointer, byte), ir.Constant(word, 1),
                                    ir.Constant(word, 3), ir.Constant(word, 1)])
        return context.get_dummy_value()

    return types.void(rows, row), codegen


def host_rows(flat: torch.Tensor | None, delta_dtype: torch.dtype) -> np.ndarray | None:
    """``flat`` (a :class:`~antdt.sync.rows.RowSpace`'s view over its tables) as the
    ``(rows, dim)`` float32 array the kernels write through, or None when they do not serve it
    (tables not end to end, not float32, not in host memory, or deltas in another dtype)."""
    if flat is None or flat.device.type != "cpu" or flat.dtype != torch.float32 \
            or delta_dtype not in KERNEL_DELTAS or not flat.is_contiguous():
        return None
    return flat.numpy()


def true_rows(mask: np.ndarray) -> np.ndarray:
    """The rows where ``mask`` (``(rows,)`` bool) is true: ``(k,)`` int64, increasing, as
    ``np.flatnonzero`` gives them. It skips the mask's zero words (8 rows each) and takes a
    word's rows without a branch. A round's touched rows are a few percent of millions: 36,000
    of 650,000 rows in 0.42 ms, against 0.70 for ``np.flatnonzero`` and 0.48 for
    ``Tensor.nonzero``; of 2.6M rows in 0.76 ms, against 1.06 and 1.23."""
    if not mask.flags.c_contiguous or mask.ctypes.data % 8:  # a view: not whole words
        return np.flatnonzero(mask)
    count = int(np.count_nonzero(mask))
    rows = np.empty(count + 8, np.int64)  # each row of a word is written before it is counted
    _true_rows(mask[: len(mask) // 8 * 8].view(np.uint64), mask, rows)
    return rows[:count]


@numba.njit(f"int64({_WORDS}, {_MASK}, {_IDS})", nogil=True, cache=True)
def _true_rows(words, mask, rows):  # type: ignore[no-untyped-def]
    """Write the rows where ``mask`` is true to ``rows`` (at least 8 longer than their count),
    ``words`` being the mask's whole words; return their count."""
    count = 0
    for word in range(words.shape[0]):
        if words[word] != 0:
            for row in range(word * 8, word * 8 + 8):
                rows[count] = row
                count += mask[row]
    for row in range(words.shape[0] * 8, mask.shape[0]):
        rows[count] = row
        count += mask[row]
    return count


def bits(tensor: torch.Tensor) -> np.ndarray:
    """A bfloat16 tensor's bits as a uint16 array over the same memory."""
    return tensor.view(torch.int16).numpy().view(np.uint16)


@numba.njit(f"void({_ROWS}, {_ROWS}, {_MASK}, {_IDS}, {_ROWS})", nogil=True, cache=True)
def add(tables, base, changed, ids, deltas):  # type: ignore[no-untyped-def]
    """``tables[ids] += deltas``, ``base[ids] += deltas``, ``changed[ids] = True``."""
    count = ids.shape[0]
    for i in range(count):
        if i + PREFETCH_ROWS < count:
            _prefetch(tables, ids[i + PREFETCH_ROWS])
            _prefetch(base, ids[i + PREFETCH_ROWS])
        row = ids[i]
        for j in range(tables.shape[1]):
            delta = deltas[i, j]
            tables[row, j] += delta
            base[row, j] += delta
        changed[row] = True


@numba.njit(f"void({_ROWS}, {_ROWS}, {_MASK}, {_IDS}, {_BITS})", nogil=True, cache=True)
def add_bfloat16(tables, base, changed, ids, deltas):  # type: ignore[no-untyped-def]
    """:func:`add` of bfloat16 ``deltas`` (their bits), each widened exactly to float32."""
    count = ids.shape[0]
    for i in range(count):
        if i + PREFETCH_ROWS < count:
            _prefetch(tables, ids[i + PREFETCH_ROWS])
            _prefetch(base, ids[i + PREFETCH_ROWS])
        row = ids[i]
        for j in range(tables.shape[1]):
            delta = np.uint32(np.uint32(deltas[i, j]) << 16).view(np.float32)
            tables[row, j] += delta
            base[row, j] += delta
        changed[row] = True


@numba.njit(f"void({_ROWS}, {_ROWS}, {_MASK}, {_IDS}, {_ROWS})", nogil=True, cache=True)
def cut(tables, base, changed, ids, deltas):  # type: ignore[no-untyped-def]
    """``deltas = tables[ids] - base[ids]``, then ``base[ids] = tables[ids]`` and
    ``changed[ids] = True``."""
    count = ids.shape[0]
    for i in range(count):
        if i + PREFETCH_ROWS < count:
            _prefetch(tables, ids[i + PREFETCH_ROWS])
            _prefetch(base, ids[i + PREFETCH_ROWS])
        row = ids[i]
        for j in range(tables.shape[1]):
            current = tables[row, j]
            deltas[i, j] = current - base[row, j]
            base[row, j] = current
        changed[row] = True


@numba.njit(f"void({_ROWS}, {_ROWS}, {_MASK}, {_MASK}, {_IDS}, {_BITS})", nogil=True,
            cache=True)
def cut_bfloat16(tables, base, changed, owed, ids, deltas):  # type: ignore[no-untyped-def]
    """:func:`cut` with each delta rounded to bfloat16 (``deltas`` gets its bits); the base
    advances by the rounded delta, not to the tables, and ``owed[ids] = True``."""
    count = ids.shape[0]
    for i in range(count):
        if i + PREFETCH_ROWS < count:
            _prefetch(tables, ids[i + PREFETCH_ROWS])
            _prefetch(base, ids[i + PREFETCH_ROWS])
        row = ids[i]
        for j in range(tables.shape[1]):
            old = base[row, j]
            exact = np.float32(tables[row, j] - old)
            word = exact.view(np.uint32)
            if exact != exact:
                rounded = np.uint32(0xFFFF)
            else:
                rounded = np.uint32((word + 0x7FFF + ((word >> 16) & 1)) >> 16)
            deltas[i, j] = np.uint16(rounded)
            base[row, j] = old + np.uint32(rounded << 16).view(np.float32)
        changed[row] = True
        owed[row] = True

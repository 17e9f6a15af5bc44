"""Stable hashing of sparse feature values into embedding buckets.

Every sparse value becomes a bucket in ``[1, num_embeddings)``; bucket 0 (``NULL_BUCKET``) is
reserved for nulls. The functions here are the one definition of that mapping: the reader, the
synthetic-data generator (which picks its raw ids so the frequent ones never collide) and any
serving code must agree on it, across processes, machines and Python versions. So nothing here
uses Python's ``hash()`` (salted per process); everything is plain 64-bit integer arithmetic in
numpy, which wraps modulo 2**64 identically on every machine.

The mapping, in two steps:

1. **A 64-bit key per value.** An integer is its two's-complement ``int64`` value (so ``7`` stored
   as int32 or int64 gives the same key). A string is the 64-bit FNV-1a hash of its UTF-8 bytes.
2. **A bucket.** ``1 + (((key * PHI) mod 2**64 >> 32) * (num_embeddings - 1)) >> 32``: Fibonacci
   hashing (Knuth, TAOCP 6.4: multiply by ``PHI = 2**64 / golden ratio``, odd, so the map is a
   bijection of 64-bit keys, and keep the high 32 bits, which depend on every bit of the key),
   then Lemire's multiply-shift reduction of those 32 bits onto ``[1, num_embeddings)``. Tables
   with ``num_embeddings - 1 >= 2**32`` fall back to ``1 + (h ^ (h >> 32)) mod (num_embeddings -
   1)`` with ``h = (key * PHI) mod 2**64``.

Why not a full avalanche mix such as splitmix64 (three xor-shifts, two multiplies) followed by a
modulo: that is 14 numpy passes over every id instead of 5, one of them a slow 64-bit division;
five times the hashing time (26 columns of 64k ids: 32 ms against 6 ms), and the reader must keep
up with bare pyarrow decoding (see :mod:`data.reader`). Fibonacci hashing spreads both
consecutive ids and random ids evenly over the buckets (tested), which is all an embedding table
needs.

    >>> import numpy as np
    >>> hash_ints(np.array([0, 1, 2, 1]), 100)
    array([ 1, 62, 24, 62])
    >>> hash_strings(["a", "b", "a"], 100)
    array([38, 78, 38])

Strings are hashed once per *distinct* value: callers hand over an Arrow dictionary (see
:func:`hash_arrow`), and :func:`fnv1a64` runs FNV-1a over the dictionary's byte buffer one byte
position at a time for all strings together, longest first, so the cost is the dictionary's byte
count plus its longest string, with no Python loop per string.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

_U64 = np.uint64
_PHI = _U64(0x9E3779B97F4A7C15)
_FNV_OFFSET = _U64(0xCBF29CE484222325)
_FNV_PRIME = _U64(0x100000001B3)
_LEMIRE_LIMIT = 1 << 32

Buckets = npt.NDArray[np.int64]


def to_buckets(keys: npt.NDArray[np.uint64], num_embeddings: int,
               out: npt.NDArray[np.int64] | None = None) -> Buckets:
    """Buckets in ``[1, num_embeddings)`` of 64-bit keys (module docstring, step 2).

    ``keys`` is not modified. ``out`` (int64, shape of ``keys``) receives the buckets when given,
    so a caller can fill a row of a larger array without a copy; five passes, all in place.
    """
    if num_embeddings < 2:
        raise ValueError(f"num_embeddings must be >= 2 (bucket 0 is for nulls), "
                         f"found {num_embeddings}")
    hashed = np.empty(keys.shape, dtype=np.uint64) if out is None else out.view(np.uint64)
    np.multiply(keys, _PHI, out=hashed)
    span = num_embeddings - 1
    if span < _LEMIRE_LIMIT:
        hashed >>= _U64(32)
        hashed *= _U64(span)
        hashed >>= _U64(32)
    else:
        # The low bits of a product depend only on the key's low bits: fold the high half in.
        hashed ^= hashed >> _U64(32)
        np.remainder(hashed, _U64(span), out=hashed)
    hashed += _U64(1)
    return hashed.view(np.int64)


def hash_ints(values: npt.ArrayLike, num_embeddings: int,
              out: npt.NDArray[np.int64] | None = None) -> Buckets:
    """Buckets of integer ids, shape of ``values``; ``values`` itself is not modified."""
    keys = np.asarray(values)
    if keys.dtype != np.int64:
        keys = keys.astype(np.int64)
    return to_buckets(keys.view(np.uint64), num_embeddings, out)


def fnv1a64(data: npt.NDArray[np.uint8], offsets: npt.NDArray[np.integer]
            ) -> npt.NDArray[np.uint64]:
    """64-bit FNV-1a of each string ``data[offsets[i]:offsets[i + 1]]``, shape
    ``(len(offsets) - 1,)``.

    Vectorised over strings: strings are ordered longest first, so at byte position ``j`` the
    strings still going are a prefix of that order and each step touches only them.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    starts = offsets[:-1]
    lengths = np.diff(offsets)
    order = np.argsort(-lengths, kind="stable")
    sorted_starts = starts[order]
    sorted_lengths = lengths[order]
    hashes = np.full(len(order), _FNV_OFFSET, dtype=np.uint64)
    longest = int(sorted_lengths[0]) if len(order) else 0
    # Strings longer than j form the prefix [:still_going[j]] of the length-descending order.
    still_going = len(order) - np.searchsorted(sorted_lengths[::-1], np.arange(longest),
                                               side="right")
    for j in range(longest):
        k = int(still_going[j])
        head = hashes[:k]
        head ^= data[sorted_starts[:k] + j].astype(np.uint64)
        head *= _FNV_PRIME
    result = np.empty_like(hashes)
    result[order] = hashes
    return result


def hash_strings(values: Iterable[str], num_embeddings: int) -> Buckets:
    """Buckets of Python strings (a convenience for tests and serving; readers use Arrow)."""
    return hash_arrow(pa.array(list(values), type=pa.string()), num_embeddings)


def _string_buckets(strings: pa.Array, num_embeddings: int) -> Buckets:
    """Buckets of a (large_)string array without nulls-handling: one per element."""
    if pa.types.is_large_string(strings.type):
        offset_type: type[np.integer] = np.int64
    else:
        strings = strings.cast(pa.string())
        offset_type = np.int32
    _, offsets_buf, data_buf = strings.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=offset_type, count=len(strings) + 1,
                            offset=strings.offset * np.dtype(offset_type).itemsize)
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None \
        else np.empty(0, dtype=np.uint8)
    return to_buckets(fnv1a64(data, offsets), num_embeddings)


def zero_nulls(values: npt.NDArray[np.int64] | npt.NDArray[np.float32],
               array: pa.Array) -> None:
    """Set ``values[i]`` to 0 wherever ``array[i]`` is null (``values`` finite, one per element
    of ``array``): bucket 0 is ``NULL_BUCKET``, and 0.0 a null dense value.

    One branch-free pass, multiplying in place by the validity bits, where a masked
    ``np.copyto(..., where=~valid)`` inverts the mask and then branches on every element (about
    3x slower at a few percent of nulls).
    """
    if not array.null_count:
        return
    bitmap = np.frombuffer(array.buffers()[0], dtype=np.uint8)
    bits = np.unpackbits(bitmap, bitorder="little", count=array.offset + len(array))
    np.multiply(values, bits[array.offset:], out=values)


def int64_values(array: pa.Array) -> npt.NDArray[np.int64]:
    """The values of an integer array as int64, without a copy for int64 arrays (read-only;
    null slots hold arbitrary values: callers overwrite what they compute from them)."""
    if array.type != pa.int64():
        array = pc.cast(array, pa.int64(), safe=False)
    return np.frombuffer(array.buffers()[1], dtype=np.int64, count=len(array),
                         offset=array.offset * 8)


def hash_arrow(array: pa.Array, num_embeddings: int,
               out: npt.NDArray[np.int64] | None = None) -> Buckets:
    """Buckets of one Arrow array of integers or strings, shape ``(len(array),)``; nulls -> 0.

    Integers of any width are hashed as int64, straight from the Arrow buffer. Strings
    (``string``, ``large_string`` or a dictionary of either) are dictionary-encoded first, so
    each distinct value is hashed once and the buckets are gathered by index. ``out``, when
    given, receives the buckets (see :func:`to_buckets`).
    """
    kind = array.type
    if len(array) == 0:
        buckets = np.empty(0, dtype=np.int64) if out is None else out
    elif pa.types.is_integer(kind):
        buckets = to_buckets(int64_values(array).view(np.uint64), num_embeddings, out)
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind) \
            or pa.types.is_dictionary(kind):
        encoded = array if pa.types.is_dictionary(kind) else pc.dictionary_encode(array)
        dict_buckets = _distinct_buckets(encoded.dictionary, num_embeddings)
        indices = encoded.indices
        index_values = (pc.fill_null(indices, 0) if indices.null_count else indices).to_numpy()
        if not len(dict_buckets):
            dict_buckets = np.zeros(1, dtype=np.int64)
        buckets = np.take(dict_buckets, index_values, out=out)
    else:
        raise TypeError(f"cannot hash Arrow type {kind}: expected integers or strings")
    zero_nulls(buckets, array)
    return buckets


def _distinct_buckets(dictionary: pa.Array, num_embeddings: int) -> Buckets:
    """Buckets of the values of an Arrow dictionary (distinct values), nulls -> 0."""
    kind = dictionary.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        buckets = _string_buckets(dictionary, num_embeddings)
        zero_nulls(buckets, dictionary)
        return buckets
    return hash_arrow(dictionary, num_embeddings)

"""Hashing of sparse values: pinned (stable across processes and machines), in range, nulls -> 0,
strings hashed the same whatever their Arrow encoding."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data.hashing import fnv1a64, hash_arrow, hash_ints, hash_strings, zero_nulls


def test_pinned_values() -> None:
    """These numbers are part of every trained model: a change here invalidates them all."""
    ids = np.array([0, 1, 42, -1, 2**62, 123456789])
    assert hash_ints(ids, 100_000).tolist() == [1, 61803, 95742, 38197, 25000, 74392]
    assert hash_strings(["", "a", "criteo", "héllo"], 1000).tolist() == [971, 378, 916, 646]
    assert hash_ints(np.array([7, 2**40, 2**41]), 2**33 + 1).tolist() == \
        [680341634, 1249645825, 2499291649]


def test_same_buckets_in_another_process_with_another_hash_seed() -> None:
    code = ("import numpy as np; from data.hashing import hash_ints, hash_strings; "
            "print(hash_strings(['x', 'yz'], 997).tolist(), "
            "hash_ints(np.array([5, 6]), 997).tolist())")
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
               for seed in ("1", "2")}
    here = f"{hash_strings(['x', 'yz'], 997).tolist()} {hash_ints(np.array([5, 6]), 997).tolist()}"
    assert outputs == {here + "\n"}


@settings(max_examples=50, deadline=None)
@given(ids=st.lists(st.integers(min_value=-2**63, max_value=2**63 - 1), min_size=1, max_size=50),
       num_embeddings=st.integers(min_value=2, max_value=2**40))
def test_int_buckets_in_range(ids: list[int], num_embeddings: int) -> None:
    buckets = hash_ints(np.array(ids, dtype=np.int64), num_embeddings)
    assert buckets.dtype == np.int64
    assert ((buckets >= 1) & (buckets < num_embeddings)).all()


def test_spread_evenly() -> None:
    counts = np.bincount(hash_ints(np.arange(1_000_000), 101), minlength=101)
    assert counts[0] == 0
    assert counts[1:].min() > 0.95 * 10_000 and counts[1:].max() < 1.05 * 10_000
    random_ids = np.random.default_rng(0).integers(-2**63, 2**63 - 1, 1_000_000, dtype=np.int64)
    counts = np.bincount(hash_ints(random_ids, 11), minlength=11)[1:]
    assert counts.min() > 0.97 * 100_000 and counts.max() < 1.03 * 100_000


def test_integer_widths_agree_and_nulls_go_to_bucket_zero() -> None:
    values = [3, None, 7000, -5]
    expected = hash_ints(np.array([3, 0, 7000, -5]), 1000)
    expected[1] = 0
    for kind in (pa.int64(), pa.int32(), pa.int16()):
        assert hash_arrow(pa.array(values, type=kind), 1000).tolist() == expected.tolist()
    sliced = pa.array([9, 3, None, 7000, -5], type=pa.int32()).slice(1)
    assert hash_arrow(sliced, 1000).tolist() == expected.tolist()
    out = np.full(4, -1, dtype=np.int64)
    assert hash_arrow(pa.array(values), 1000, out=out) is not None
    assert out.tolist() == expected.tolist()


def test_zero_nulls_reads_the_bitmap_of_sliced_arrays() -> None:
    # 11 values, so the bitmap has a partial last byte; slices start inside a byte.
    array = pa.array([None, 1, 2, None, 4, 5, 6, 7, None, 9, None], type=pa.int64())
    for start in (0, 1, 3, 7):
        part = array.slice(start)
        valid = np.array([v is not None for v in part.to_pylist()])
        for values in (np.arange(1, len(part) + 1, dtype=np.int64),
                       np.linspace(0.5, 3.0, len(part), dtype=np.float32)):
            expected = np.where(valid, values, 0)
            zero_nulls(values, part)
            assert values.tolist() == expected.tolist()
    untouched = np.array([5, 6], dtype=np.int64)
    zero_nulls(untouched, pa.array([1, 2]))
    assert untouched.tolist() == [5, 6]


def test_strings_agree_across_encodings() -> None:
    values = ["apple", None, "", "pear", "apple", "ünïcode"]
    expected = hash_strings(["apple", "x", "", "pear", "apple", "ünïcode"], 500)
    expected[1] = 0
    plain = pa.array(values, type=pa.string())
    for array in (plain, pa.array(values, type=pa.large_string()), plain.dictionary_encode(),
                  pa.array(["zzz", *values]).slice(1)):
        assert hash_arrow(array, 500).tolist() == expected.tolist()
    assert hash_arrow(pa.array([None, None], type=pa.string()), 500).tolist() == [0, 0]
    assert hash_arrow(pa.array([], type=pa.string()), 500).tolist() == []


def fnv_reference(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) % 2**64
    return h


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(max_size=40), min_size=1, max_size=30))
def test_fnv1a64_matches_the_reference(strings: list[str]) -> None:
    encoded = [s.encode() for s in strings]
    offsets = np.cumsum([0, *(len(b) for b in encoded)])
    data = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    assert fnv1a64(data, offsets).tolist() == [fnv_reference(b) for b in encoded]


def test_unhashable_type_and_bad_table_size() -> None:
    with pytest.raises(TypeError, match="cannot hash Arrow type double"):
        hash_arrow(pa.array([1.5]), 10)
    with pytest.raises(ValueError, match="num_embeddings must be >= 2"):
        hash_ints(np.array([1]), 1)

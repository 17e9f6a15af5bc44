"""antdt.sync.kernels compute, bit for bit, what the torch index operations they replace compute,
on every kind of float32: ties of the bfloat16 rounding, subnormals, signed zeros, infinities,
overflow to infinity and NaN."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from antdt.sync import kernels

ROWS, DIM = 4096, 16


def special_values(count: int, seed: int) -> torch.Tensor:
    """``count`` float32 values, a quarter of each: bfloat16 rounding ties (low half word
    0x8000, with even and odd kept bits), named specials (signed zeros, infinities, a NaN, the
    largest finite values, subnormals), random bits over every exponent, and random normals."""
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 2**32, count, dtype=np.uint64).astype(np.uint32)
    quarter = count // 4
    words[:quarter] = (words[:quarter] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)
    named = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-45, -1e-45,
                      1.1754942e-38, 1.0, -1.0], dtype=np.float32).view(np.uint32)
    words[quarter:2 * quarter] = rng.permutation(np.resize(named, quarter))
    words[3 * quarter:] = rng.standard_normal(count - 3 * quarter).astype(np.float32).view(
        np.uint32)
    return torch.from_numpy(rng.permutation(words).view(np.float32))


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits, but that a NaN may be any NaN: which operand's payload NaN + NaN keeps is
    up to the instruction the compiler picks (a NaN delta on a NaN row)."""
    return bool(((bits(a) == bits(b)) | (a.isnan() & b.isnan())).all())


def rows_and_ids(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tables and a base full of special values, and 1,500 increasing row ids."""
    tables = special_values(ROWS * DIM, seed).view(ROWS, DIM)
    base = special_values(ROWS * DIM, seed + 1).view(ROWS, DIM)
    base[: ROWS // 2] = 0.0  # there the delta is the tables' value itself: every special as is
    ids = torch.randperm(ROWS, generator=torch.Generator().manual_seed(seed))[:1500].sort().values
    return tables, base, ids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_rounded_cut_is_torch_s_select_subtract_round_and_copy(seed: int) -> None:
    tables, base, ids = rows_and_ids(seed)
    expected_base = base.clone()
    old = expected_base.index_select(0, ids)
    expected = tables.index_select(0, ids).sub_(old).to(torch.bfloat16)
    expected_base.index_copy_(0, ids, old.add_(expected))

    deltas = torch.empty(len(ids), DIM, dtype=torch.bfloat16)
    changed, owed = torch.zeros(ROWS, dtype=torch.bool), torch.zeros(ROWS, dtype=torch.bool)
    before = tables.clone()
    kernels.cut_bfloat16(tables.numpy(), base.numpy(), changed.numpy(), owed.numpy(),
                         ids.numpy(), kernels.bits(deltas))
    assert torch.equal(bits(deltas), bits(expected))
    assert same(base, expected_base)
    assert torch.equal(bits(tables), bits(before))
    marked = torch.zeros(ROWS, dtype=torch.bool).index_fill_(0, ids, True)
    assert torch.equal(changed, marked) and torch.equal(owed, marked)
    assert bool(deltas.isnan().any()) and bool(deltas.isinf().any())  # the specials were cut


@pytest.mark.parametrize("seed", [0, 1])
def test_an_exact_cut_is_torch_s_select_subtract_and_copy(seed: int) -> None:
    tables, base, ids = rows_and_ids(seed)
    expected = tables.index_select(0, ids) - base.index_select(0, ids)
    expected_base = base.clone().index_copy_(0, ids, tables.index_select(0, ids))

    deltas = torch.empty(len(ids), DIM)
    changed = torch.zeros(ROWS, dtype=torch.bool)
    kernels.cut(tables.numpy(), base.numpy(), changed.numpy(), ids.numpy(), deltas.numpy())
    assert same(deltas, expected)
    assert torch.equal(bits(base), bits(expected_base))
    assert int(changed.sum()) == len(ids)


@pytest.mark.parametrize("delta_dtype", [torch.float32, torch.bfloat16])
def test_a_merge_is_torch_s_two_index_adds(delta_dtype: torch.dtype) -> None:
    tables, base, ids = rows_and_ids(3)
    deltas = special_values(len(ids) * DIM, 9).view(len(ids), DIM).to(delta_dtype)
    widened = deltas.to(torch.float32)
    expected_tables = tables.clone().index_add_(0, ids, widened)
    expected_base = base.clone().index_add_(0, ids, widened)

    changed = torch.zeros(ROWS, dtype=torch.bool)
    if delta_dtype == torch.bfloat16:
        kernels.add_bfloat16(tables.numpy(), base.numpy(), changed.numpy(), ids.numpy(),
                             kernels.bits(deltas))
    else:
        kernels.add(tables.numpy(), base.numpy(), changed.numpy(), ids.numpy(), deltas.numpy())
    assert same(tables, expected_tables)
    assert same(base, expected_base)
    assert torch.equal(changed, torch.zeros(ROWS, dtype=torch.bool).index_fill_(0, ids, True))


@pytest.mark.parametrize(("flat", "delta_dtype", "served"), [
    (torch.zeros(8, 4), torch.bfloat16, True),
    (torch.zeros(8, 4), torch.float32, True),
    (torch.zeros(8, 4), torch.float16, False),
    (torch.zeros(8, 4, dtype=torch.float64), torch.float64, False),
    (None, torch.float32, False),
])
def test_the_kernels_serve_float32_host_tables_with_float32_or_bfloat16_deltas(
        flat: torch.Tensor | None, delta_dtype: torch.dtype, served: bool) -> None:
    host = kernels.host_rows(flat, delta_dtype)
    assert (host is not None) == served
    if host is not None and flat is not None:
        host[1, 2] = 5.0
        assert flat[1, 2] == 5.0  # the same memory


@pytest.mark.parametrize("count", [0, 1, kernels.PREFETCH_ROWS - 1, kernels.PREFETCH_ROWS,
                                   kernels.PREFETCH_ROWS + 1])
def test_the_kernels_asking_rows_ahead_stop_at_the_last_id(count: int) -> None:
    """Around the prefetch distance: every row is cut and merged, and rows past the ids (the
    tables' last, which no id names) stay untouched."""
    tables = torch.arange(ROWS * DIM, dtype=torch.float32).view(ROWS, DIM)
    base = torch.zeros(ROWS, DIM)
    ids = torch.arange(count, dtype=torch.int64) * 3
    changed, owed = torch.zeros(ROWS, dtype=torch.bool), torch.zeros(ROWS, dtype=torch.bool)
    deltas = torch.empty(count, DIM, dtype=torch.bfloat16)
    kernels.cut_bfloat16(tables.numpy(), base.numpy(), changed.numpy(), owed.numpy(),
                         ids.numpy(), kernels.bits(deltas))
    assert torch.equal(deltas, tables[ids].to(torch.bfloat16))
    assert torch.equal(base[ids], deltas.to(torch.float32))
    assert int(changed.sum()) == int(owed.sum()) == count

    exact = torch.empty(count, DIM)
    kernels.cut(tables.numpy(), base.numpy(), changed.numpy(), ids.numpy(), exact.numpy())
    assert torch.equal(base[ids], tables[ids])
    expected = tables.clone().index_add_(0, ids, exact).index_add_(0, ids,
                                                                    deltas.to(torch.float32))
    kernels.add(tables.numpy(), base.numpy(), changed.numpy(), ids.numpy(), exact.numpy())
    kernels.add_bfloat16(tables.numpy(), base.numpy(), changed.numpy(), ids.numpy(),
                         kernels.bits(deltas))
    assert torch.equal(tables, expected)  # the rows past the ids included
    assert not bool(base[ids.max() + 1 if count else 0:].any())


@pytest.mark.parametrize("rows", [0, 5, 8, 4099])
@pytest.mark.parametrize("share", [0.0, 0.02, 0.5, 1.0])
def test_true_rows_are_numpy_s_flatnonzero(rows: int, share: float) -> None:
    """Whole words and a tail, sparse to full masks; a view off a word boundary and a strided
    one take numpy's path and agree too."""
    mask = np.random.default_rng(rows).random(rows + 9) < share
    for view in (mask[:rows], mask[1:rows + 1], mask[: rows + 9: 2]):
        found = kernels.true_rows(view)
        assert found.dtype == np.int64
        assert np.array_equal(found, np.flatnonzero(view))

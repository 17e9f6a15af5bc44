"""The synthetic data generator: layout, determinism, oracle, and the data it writes read back."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from antdt.errors import ConfigError
from data.files import expand, row_groups
from data.hashing import hash_arrow
from data.reader import ShardReader
from data.schema import Schema
from data.synth import SynthResult, _OracleDay, generate, write_parquet
from data.validate import validate

SMALL = dict(rows=10_000, days=2, row_group_rows=2_000, files_per_day=2, num_dense=3,
             num_sparse=4)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> SynthResult:
    return generate(str(tmp_path_factory.mktemp("synth") / "out"), seed=3, **SMALL)


def file_bytes(result: SynthResult) -> dict[str, bytes]:
    root = Path(result.out)
    return {str(p.relative_to(root)): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_layout_schema_and_row_groups(small: SynthResult) -> None:
    root = Path(small.out)
    assert [str(Path(f).relative_to(root)) for f in small.files] == [
        "date=2026-11-01/part-00000.parquet", "date=2026-11-01/part-00001.parquet",
        "date=2026-11-02/part-00000.parquet", "date=2026-11-02/part-00001.parquet"]
    assert expand(small.out) == small.files
    assert [g.num_rows for g in row_groups(small.files[:1])] == [2_000, 500]
    assert sum(g.num_rows for g in row_groups(small.files)) == small.rows == 10_000
    assert Schema.from_yaml(root / "schema.yaml") == small.schema
    assert small.schema.columns == ["label", "I1", "I2", "I3", "C1", "C2", "C3", "C4"]
    arrow = pq.ParquetFile(small.files[0]).schema_arrow
    assert arrow.field("label").type == pa.int8()
    assert all(arrow.field(c).type == pa.int64() for c in small.schema.columns[1:])
    assert validate(small.files, small.schema).ok


def test_same_arguments_same_bytes_other_seed_other_data(small: SynthResult,
                                                         tmp_path: Path) -> None:
    again = generate(str(tmp_path / "again"), seed=3, **SMALL)
    assert file_bytes(again) == file_bytes(small)
    other = generate(str(tmp_path / "other"), seed=4, **SMALL)
    assert file_bytes(other).keys() == file_bytes(small).keys()
    first, second = (pq.read_table(r.files[0]) for r in (small, other))
    assert first.schema == second.schema
    assert not first.column("C1").equals(second.column("C1"))
    assert not first.column("label").equals(second.column("label"))


def test_oracle(small: SynthResult) -> None:
    saved = json.loads((Path(small.out) / "oracle.json").read_text())
    assert saved == small.oracle
    assert saved["seed"] == 3 and saved["rows"] == 10_000
    assert "drift" not in saved
    assert list(saved["per_day"]) == ["2026-11-01", "2026-11-02"]
    for day in saved["per_day"].values():
        assert day["rows"] == 5_000
        assert 0.7 < day["auc"] < 0.9
        assert 0.3 < day["logloss"] < 0.55
        assert 0.18 < day["ctr"] < 0.32


def test_the_default_data_has_not_changed(tmp_path: Path) -> None:
    """The default data (no drift) is pinned: its values and oracle as generated when drift was
    added, so the benchmarks' figures stay comparable. (A numpy whose ``exp``/``log`` rounds
    differently, see the module docstring of :mod:`data.synth`, would fail this too.)"""
    result = generate(str(tmp_path / "g"), rows=3_000, days=2, seed=5, row_group_rows=1_000,
                      files_per_day=1, num_dense=2, num_sparse=3, with_string=True,
                      with_multi_valued=True)
    digest = hashlib.sha256()
    for path in result.files:
        table = pq.read_table(path)
        for name in table.column_names:
            digest.update(str(table.column(name).to_pylist()).encode())
    assert digest.hexdigest() == \
        "c590a79afea95bd5dccc0724e9fd5ad5aa3cd78e52caec07157fee3505567a80"
    assert [(f.name, f.num_embeddings) for f in result.schema.sparse] == [
        ("C1", 20), ("C2", 2000), ("C3", 200000), ("S1", 2000), ("M1", 2000)]
    assert result.oracle["per_day"] == {
        "2026-11-01": {"auc": pytest.approx(0.7993676534390166, abs=1e-12),
                       "logloss": pytest.approx(0.4644868410326405, abs=1e-12),
                       "ctr": 0.2713333333333333, "rows": 1500},
        "2026-11-02": {"auc": pytest.approx(0.8355389223898574, abs=1e-12),
                       "logloss": pytest.approx(0.3913201621456489, abs=1e-12),
                       "ctr": 0.218, "rows": 1500}}


def test_histogram_auc_matches_the_exact_auc() -> None:
    rng = np.random.default_rng(0)
    logit = rng.normal(-1.0, 1.5, 20_000)
    labels = rng.random(20_000) < 1 / (1 + np.exp(-logit))
    oracle = _OracleDay()
    oracle.add(logit[:7_000], labels[:7_000])
    oracle.add(logit[7_000:], labels[7_000:])
    ranks = np.empty(len(logit))
    ranks[np.argsort(logit)] = np.arange(1, len(logit) + 1)
    positives = int(labels.sum())
    exact = (ranks[labels].sum() - positives * (positives + 1) / 2) / \
        (positives * (len(logit) - positives))
    summary = oracle.summary()
    assert summary["auc"] == pytest.approx(exact, abs=1e-4)
    p = 1 / (1 + np.exp(-logit))
    assert summary["logloss"] == pytest.approx(
        -np.mean(np.where(labels, np.log(p), np.log(1 - p))), rel=1e-9)
    assert summary["rows"] == 20_000 and summary["ctr"] == pytest.approx(labels.mean())


def test_progress_counts_every_row(tmp_path: Path) -> None:
    seen: list[int] = []
    generate(str(tmp_path / "p"), rows=5_001, days=1, row_group_rows=1_000, files_per_day=2,
             num_dense=1, num_sparse=2, progress=seen.append)
    assert sum(seen) == 5_001
    assert max(seen) == 1_000


def test_frequent_ids_never_share_a_bucket(small: SynthResult) -> None:
    table = pq.read_table(small.files)
    for feature in small.schema.sparse:
        ids = pc.unique(table.column(feature.name).combine_chunks().drop_null())
        buckets = hash_arrow(ids, feature.num_embeddings)
        assert len(np.unique(buckets)) == len(ids), feature.name
        assert feature.num_embeddings >= 2 * len(ids)


def test_string_and_multi_valued_features_end_to_end(tmp_path: Path) -> None:
    result = generate(str(tmp_path / "x"), rows=4_000, days=1, row_group_rows=1_000,
                      files_per_day=1, num_dense=2, num_sparse=2, with_string=True,
                      with_multi_valued=True, seed=1)
    names = [(f.name, f.type, f.multi_valued) for f in result.schema.sparse]
    assert names == [("C1", "int", False), ("C2", "int", False), ("S1", "string", False),
                     ("M1", "int", True)]
    table = pq.read_table(result.files[0])
    lists = table.column("M1").combine_chunks()
    assert pa.types.is_list(lists.type) and lists.null_count > 0
    lengths = pc.fill_null(pc.list_value_length(lists), 0).to_numpy()
    assert lengths.min() == 0 and lengths.max() >= 4
    assert pa.types.is_string(table.column("S1").type.value_type)
    assert validate(result.files, result.schema).ok
    reader = ShardReader(result.schema)
    batch = reader.read(result.files[0], 0, 0, 1_000)
    bag = batch.sparse_features["M1"]
    bag_sizes = np.maximum(lengths[:1_000], 1)
    assert bag.lengths().tolist() == bag_sizes.tolist()
    placeholder = np.repeat(lengths[:1_000] == 0, bag_sizes)  # a null or empty list's slot
    assert (bag.values().numpy()[placeholder] == 0).all()
    raw = pc.list_flatten(lists.slice(0, 1_000))
    feature = result.schema.sparse[3]
    assert bag.values().numpy()[~placeholder].tolist() == \
        hash_arrow(raw, feature.num_embeddings).tolist()
    assert 0.7 < result.oracle["per_day"]["2026-11-01"]["auc"] < 0.9


@pytest.mark.parametrize("changes, message", [
    ({"rows": 0}, "rows must be >= 1, found 0"),
    ({"days": 0}, "days must be >= 1, found 0"),
    ({"row_group_rows": 0}, "row_group_rows must be >= 1, found 0"),
    ({"rows": 3, "days": 2}, r"rows must be >= days \* files_per_day \(2 \* 2\)"),
    ({"num_sparse": 0}, "expected at least one sparse feature"),
])
def test_bad_arguments(tmp_path: Path, changes: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        generate(str(tmp_path / "bad"), **{**SMALL, "files_per_day": 2, **changes})


def test_write_parquet_helper(tmp_path: Path) -> None:
    target = write_parquet(str(tmp_path / "d" / "t.parquet"),
                           {"a": np.arange(10), "b": ["x"] * 10}, row_group_rows=4)
    assert [g.num_rows for g in row_groups([target])] == [4, 4, 2]
    assert pq.read_table(target).column("a").to_pylist() == list(range(10))

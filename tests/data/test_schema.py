"""The schema: YAML round trip; malformed schemas rejected naming the key and what was expected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from antdt.errors import ConfigError
from data.schema import Schema, SparseFeature

GOOD: dict[str, Any] = {
    "label": "label",
    "dense": ["I1", "I2"],
    "sparse": [{"name": "C1", "num_embeddings": 100},
               {"name": "C2", "num_embeddings": 50, "type": "string"},
               {"name": "C3", "num_embeddings": 10, "multi_valued": True}],
}


def with_changes(**changes: Any) -> dict[str, Any]:
    raw = {**GOOD, **changes}
    return {k: v for k, v in raw.items() if v is not None}


def test_parses_and_round_trips_through_yaml(tmp_path: Path) -> None:
    schema = Schema.from_dict(GOOD)
    assert schema.columns == ["label", "I1", "I2", "C1", "C2", "C3"]
    assert schema.sparse_names == ["C1", "C2", "C3"]
    assert schema.sparse[1] == SparseFeature("C2", 50, type="string")
    assert schema.sparse[2].multi_valued
    path = tmp_path / "schema.yaml"
    schema.to_yaml(path)
    loaded = Schema.from_yaml(path)
    assert loaded == schema
    assert loaded.source == str(path)
    assert loaded.to_dict() == GOOD


def test_dense_may_be_left_out() -> None:
    schema = Schema.from_dict({"label": "y", "sparse": [{"name": "c", "num_embeddings": 2}]})
    assert schema.dense == ()


@pytest.mark.parametrize("raw, expected", [
    (["label"], "expected a mapping with keys ['dense', 'label', 'sparse'], found list"),
    (with_changes(labels="y"), "unknown key(s) ['labels']; expected only"),
    ({**GOOD, 1: "x", "zz": 2}, "unknown key(s) [1, 'zz']"),
    (with_changes(label=None), "missing key 'label'"),
    (with_changes(sparse=None), "missing key 'sparse'"),
    (with_changes(label=3), "'label' must be a column name (string), found 3"),
    (with_changes(label=""), "'label' must be a column name (string), found ''"),
    (with_changes(dense="I1"), "'dense' must be a list of column names, found 'I1'"),
    (with_changes(dense=["I1", 2]), "'dense' must be a list of column names, found ['I1', 2]"),
    (with_changes(sparse=[]), "'sparse' must be a non-empty list of features, found []"),
    (with_changes(sparse=["C1"]), "sparse[0]: expected a mapping with keys name, num_embeddings"),
    (with_changes(sparse=[{"name": "C1", "num_embeddings": 5, "hash": "x"}]),
     "sparse[0]: unknown key(s) ['hash']; expected only"),
    (with_changes(sparse=[{"num_embeddings": 5}]),
     "sparse[0]: 'name' must be a column name (string), found None"),
    (with_changes(sparse=[{"name": "C1"}]),
     "sparse[0] (C1): 'num_embeddings' must be an integer >= 2 (bucket 0 is reserved for nulls), "
     "found None"),
    (with_changes(sparse=[{"name": "C1", "num_embeddings": 1}]),
     "sparse[0] (C1): 'num_embeddings' must be an integer >= 2"),
    (with_changes(sparse=[{"name": "C1", "num_embeddings": True}]),
     "'num_embeddings' must be an integer >= 2 (bucket 0 is reserved for nulls), found True"),
    (with_changes(sparse=[{"name": "C1", "num_embeddings": "10"}]),
     "'num_embeddings' must be an integer >= 2 (bucket 0 is reserved for nulls), found '10'"),
    (with_changes(sparse=[{"name": "C1", "num_embeddings": 5}, {"name": "C2", "num_embeddings": 5,
                                                                "type": "float"}]),
     "sparse[1] (C2): 'type' must be 'int' or 'string', found 'float'"),
    (with_changes(sparse=[{"name": "C1", "num_embeddings": 5, "multi_valued": "yes"}]),
     "sparse[0] (C1): 'multi_valued' must be true or false, found 'yes'"),
    (with_changes(dense=["I1", "label"]), "column(s) ['label'] appear more than once"),
    (with_changes(sparse=[{"name": "I1", "num_embeddings": 5}]),
     "column(s) ['I1'] appear more than once"),
])
def test_malformed_schema_names_key_and_expectation(raw: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        Schema.from_dict(raw, source="s.yaml")
    message = str(info.value)
    assert message.startswith("s.yaml: ")
    assert expected in message


def test_yaml_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        Schema.from_yaml(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("label: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        Schema.from_yaml(broken)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match=f"{empty}: expected a mapping .* found NoneType"):
        Schema.from_yaml(empty)

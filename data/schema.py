"""The dataset schema: which Parquet columns are the label, the dense and the sparse features.

A schema is written in YAML::

    label: label
    dense: [I1, I2, I3]
    sparse:
      - {name: C1, num_embeddings: 100000}                  # integer ids
      - {name: C2, num_embeddings: 5000, type: string}      # strings, hashed
      - {name: C3, num_embeddings: 1000, multi_valued: true} # list<int> column

Every sparse value is hashed into ``[1, num_embeddings)``; bucket 0 is reserved for nulls
(and, in multi-valued columns, for a null list), so a missing value is a feature of its own
and never collides with a real id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import fsspec
import yaml

from antdt.errors import ConfigError

SparseType = Literal["int", "string"]
NULL_BUCKET = 0

_SCHEMA_KEYS = {"label", "dense", "sparse"}
_SPARSE_KEYS = {"name", "num_embeddings", "type", "multi_valued"}


@dataclass(frozen=True)
class SparseFeature:
    """One categorical column, hashed into ``num_embeddings`` buckets (bucket 0: null)."""

    name: str
    num_embeddings: int
    type: SparseType = "int"
    multi_valued: bool = False


def read_yaml(path: str | Path, what: str) -> Any:
    """The parsed YAML at ``path`` (a local path or fsspec URL); a missing file or bad YAML raises
    :class:`ConfigError` naming ``what`` and the path."""
    try:
        with fsspec.open(str(path), "r") as fh:
            return yaml.safe_load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(f"{what} {path} does not exist") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path} is not valid YAML: {exc}") from exc


@dataclass(frozen=True)
class Schema:
    """Label, dense and sparse columns of a ranking dataset (see the module docstring)."""

    label: str
    dense: tuple[str, ...]
    sparse: tuple[SparseFeature, ...]
    source: str = field(default="<schema>", compare=False)

    @property
    def sparse_names(self) -> list[str]:
        return [f.name for f in self.sparse]

    @property
    def columns(self) -> list[str]:
        """All columns a reader needs, label first."""
        return [self.label, *self.dense, *self.sparse_names]

    def to_dict(self) -> dict[str, Any]:
        sparse: list[dict[str, Any]] = []
        for f in self.sparse:
            entry: dict[str, Any] = {"name": f.name, "num_embeddings": f.num_embeddings}
            if f.type != "int":
                entry["type"] = f.type
            if f.multi_valued:
                entry["multi_valued"] = True
            sparse.append(entry)
        return {"label": self.label, "dense": list(self.dense), "sparse": sparse}

    def to_yaml(self, path: str | Path) -> None:
        with fsspec.open(str(path), "w") as fh:
            yaml.safe_dump(self.to_dict(), fh, sort_keys=False)

    @classmethod
    def from_yaml(cls, path: str | Path) -> Schema:
        return cls.from_dict(read_yaml(path, "schema file"), source=str(path))

    @classmethod
    def from_dict(cls, raw: Any, source: str = "<schema>") -> Schema:
        """Validate a parsed schema; every error names the offending key and what was expected."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{source}: expected a mapping with keys {sorted(_SCHEMA_KEYS)}, "
                              f"found {type(raw).__name__}")
        unknown = set(raw) - _SCHEMA_KEYS
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {sorted(unknown, key=str)}; "
                              f"expected only {sorted(_SCHEMA_KEYS)}")
        for key in ("label", "sparse"):
            if key not in raw:
                raise ConfigError(f"{source}: missing key {key!r}")
        label = raw["label"]
        if not isinstance(label, str) or not label:
            raise ConfigError(f"{source}: 'label' must be a column name (string), found {label!r}")
        dense_raw = raw.get("dense", [])
        if not isinstance(dense_raw, list) or not all(isinstance(c, str) and c for c in dense_raw):
            raise ConfigError(f"{source}: 'dense' must be a list of column names, found {dense_raw!r}")
        sparse_raw = raw["sparse"]
        if not isinstance(sparse_raw, list) or not sparse_raw:
            raise ConfigError(f"{source}: 'sparse' must be a non-empty list of features, "
                              f"found {sparse_raw!r}")
        sparse = tuple(_sparse_feature(entry, f"{source}: sparse[{i}]")
                       for i, entry in enumerate(sparse_raw))
        names = [label, *dense_raw, *(f.name for f in sparse)]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"{source}: column(s) {duplicates} appear more than once; "
                              "each column may be the label, a dense or a sparse feature, once")
        return cls(label=label, dense=tuple(dense_raw), sparse=sparse, source=source)


def _sparse_feature(entry: Any, where: str) -> SparseFeature:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: expected a mapping with keys name, num_embeddings "
                          f"[, type, multi_valued], found {entry!r}")
    unknown = set(entry) - _SPARSE_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown, key=str)}; expected only "
                          f"{sorted(_SPARSE_KEYS)}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: 'name' must be a column name (string), found {name!r}")
    where = f"{where} ({name})"
    n = entry.get("num_embeddings")
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ConfigError(f"{where}: 'num_embeddings' must be an integer >= 2 "
                          f"(bucket 0 is reserved for nulls), found {n!r}")
    kind = entry.get("type", "int")
    if kind not in ("int", "string"):
        raise ConfigError(f"{where}: 'type' must be 'int' or 'string', found {kind!r}")
    multi = entry.get("multi_valued", False)
    if not isinstance(multi, bool):
        raise ConfigError(f"{where}: 'multi_valued' must be true or false, found {multi!r}")
    return SparseFeature(name=name, num_embeddings=n, type=kind, multi_valued=multi)

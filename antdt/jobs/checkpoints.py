"""A job's checkpoints: where they live, what one version holds, how it is written atomically
and how the newest good one is found again.

Layout under the job's ``checkpoint_dir`` (a local path or any fsspec URL that the scheduler,
the workers and the submitting client all reach)::

    <checkpoint_dir>/<job_id>/
        progress.json          the master's latest note of the job (rows, state), every tick
        model/                 a sync job's final model when it does not fit one worker: the
                               parts its ranks wrote (:mod:`models.shards`), named by its run
        v000001/ v000002/ ...  one folder per checkpoint (the newest ``keep`` good ones stay)
            model.pt           model and optimiser state, ``torch.save`` of the trainer's
                               ``checkpoint_state()`` (written by a worker); or, for a sync
                               job whose model does not fit one worker, the parts its ranks
                               wrote (``model-00000-of-00003.bin`` ..., each rank its own)
            ledger.bin         the shard ledger (:mod:`antdt.sharding.checkpoint` format),
                               copied with the model and written by the same worker
            MANIFEST.json      written last: each file's size and sha256, the rows it covers,
                               the tracking run, the job's fingerprint

A version without a manifest is a torn write (the process died half-way); one whose files do
not match the manifest's sizes and checksums is corrupt. Either is skipped for the previous
version, with a warning that names it (:func:`latest`).
"""

from __future__ import annotations

import hashlib
import io
import json
import posixpath
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec

from antdt.errors import CheckpointError
from antdt.sharding.checkpoint import read, write_atomic

FORMAT = 1
MANIFEST = "MANIFEST.json"
MODEL = "model.pt"
LEDGER = "ledger.bin"
PROGRESS = "progress.json"
_VERSION = re.compile(r"^v(\d{6,})$")
_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class Every:
    """How often a job checkpoints: every ``rows`` rows trained, or every ``seconds``.

    >>> Every.parse(100_000), Every.parse("30s"), Every.parse("2m")
    (Every(rows=100000, seconds=None), Every(rows=None, seconds=30.0), Every(rows=None, seconds=120.0))
    """

    rows: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, value: object, where: str = "checkpoint_every") -> Every:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return cls(rows=value)
        if isinstance(value, str):
            text = value.strip()
            if text.isdigit() and int(text) >= 1:
                return cls(rows=int(text))
            match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|m|h)", text)
            if match and float(match[1]) > 0:
                scale = {"s": 1.0, "m": 60.0, "h": 3600.0}[match[2]]
                return cls(seconds=float(match[1]) * scale)
        raise CheckpointError(f"{where}: expected rows (an int >= 1) or a duration such as "
                              f"'60s', '5m', found {value!r}")

    def __str__(self) -> str:
        return f"{self.rows}" if self.rows is not None else f"{self.seconds:g}s"


ROWS = ("rows_done", "rows_trained", "rows_retrained", "rows_expected", "rows_quarantined",
        "epoch")
"""The ledger's counters a manifest keeps (as ``rows``, without the ``rows_`` prefix)."""


def ledger_rows(summary: Mapping[str, Any]) -> dict[str, int]:
    """A manifest's ``rows`` from a ledger's summary (:meth:`ShardLedger.summary`)."""
    return {key.removeprefix("rows_"): int(summary[key]) for key in ROWS}


@dataclass(frozen=True)
class Manifest:
    """What a checkpoint version holds (``MANIFEST.json``). ``rows``: the ledger's counters at
    the checkpoint (``done``, ``trained``, ``retrained``, ``expected``, ``epoch``); ``step``:
    the tracking run's next metrics step; ``fingerprint``: what a resumed job must not change
    (``{key: value}``, keys as in the job file)."""

    job_id: str
    version: int
    path: str
    created: float
    files: dict[str, dict[str, Any]]
    rows: dict[str, int]
    step: int
    run: dict[str, Any] | None
    fingerprint: dict[str, str]
    worker: str
    write_s: float
    format: int = FORMAT
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> str:
        return join(self.path, MODEL)

    @property
    def ledger(self) -> str:
        return join(self.path, LEDGER)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, path: str) -> Manifest:
        try:
            raw = json.loads(data)
            if raw.get("format") != FORMAT:
                raise CheckpointError(f"checkpoint {path}: manifest format {raw.get('format')!r}"
                                      f" is not supported; expected {FORMAT}")
            raw["path"] = path  # where it is now (a copied folder keeps working)
            return cls(**raw)
        except (ValueError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"checkpoint {path}: unreadable {MANIFEST}: {exc}") from exc


def join(*parts: str) -> str:
    """Path parts joined with ``/`` (fsspec URLs and local paths alike)."""
    return posixpath.join(parts[0].rstrip("/") or "/", *parts[1:])


def job_folder(root: str, job_id: str) -> str:
    return join(root, job_id)


def version_path(folder: str, version: int) -> str:
    return join(folder, f"v{version:06d}")


def digest(data: bytes) -> dict[str, Any]:
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write(path: str, data: bytes) -> dict[str, Any]:
    """Write ``data`` atomically to ``path``; its size and checksum for the manifest."""
    try:
        write_atomic(path, data)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint file {path}: {exc}") from exc
    return digest(data)


def save_model(path: str, state: Any) -> dict[str, Any]:
    """``torch.save`` of ``state`` to ``path`` (atomic); its size and checksum."""
    import torch  # here, not above: a job's spec and the job commands run without torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return write(path, buffer.getvalue())


def model_files(manifest: Manifest) -> dict[str, dict[str, Any]]:
    """The files of ``manifest``'s model (every file but the ledger: ``model.pt``, or the parts
    a sync job's ranks wrote), each with its size and sha256."""
    return {name: dict(found) for name, found in manifest.files.items() if name != LEDGER}


def load_model(manifest: Manifest) -> Any:
    """The model state of ``manifest``'s version, its checksum verified (tensors on the CPU);
    only for a version with one ``model.pt`` (the parts of a sharded model are each loaded by
    the ranks that hold them)."""
    import torch

    data = _read(manifest.model)
    _check(manifest, MODEL, data)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def load_ledger(manifest: Manifest) -> bytes:
    """The ledger bytes of ``manifest``'s version, its checksum verified."""
    data = _read(manifest.ledger)
    _check(manifest, LEDGER, data)
    return data


def write_manifest(manifest: Manifest) -> None:
    """The manifest, last: from now on the version counts."""
    write(join(manifest.path, MANIFEST), manifest.to_json())


def read_manifest(path: str) -> Manifest:
    """The manifest of the version folder ``path``; :class:`CheckpointError` when there is none
    (a torn write) or it is unreadable."""
    try:
        data = read(join(path, MANIFEST))
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST} (its write did "
                              "not finish)") from exc
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read {MANIFEST}: {exc}") from exc
    return Manifest.from_json(data, path)


def verify(path: str) -> Manifest:
    """The manifest of the version folder ``path`` once every file it lists has its size and
    checksum (read a few MB at a time: a model's files may be larger than this process's
    memory); :class:`CheckpointError` naming the file otherwise."""
    manifest = read_manifest(path)
    for name in manifest.files:
        _compare(manifest, name, _file_digest(join(path, name)))
    return manifest


def versions(folder: str) -> list[int]:
    """The version numbers in a job's checkpoint folder, oldest first ([] when it is absent)."""
    fs, root = fsspec.core.url_to_fs(folder)
    try:
        names = [posixpath.basename(str(p).rstrip("/")) for p in fs.ls(root, detail=False)]
    except FileNotFoundError:
        return []
    return sorted(int(m[1]) for m in map(_VERSION.match, names) if m)


def latest(folder: str, warn: Callable[[str], None]) -> Manifest | None:
    """The newest good checkpoint in ``folder`` (None when there is none); every newer version
    that is torn or corrupt is skipped with ``warn(message naming it)``."""
    for version in reversed(versions(folder)):
        try:
            return verify(version_path(folder, version))
        except CheckpointError as exc:
            warn(f"{exc}; using the previous checkpoint")
    return None


def resolve(ref: str, root: str | None, warn: Callable[[str], None]) -> Manifest:
    """The checkpoint ``--resume ref`` names: a job id (its newest good checkpoint under
    ``root``, the job's ``checkpoint_dir``), a job's checkpoint folder, or one version folder."""
    plain_id = "/" not in ref and ":" not in ref and not ref.startswith(".")
    if plain_id:
        if root is None:
            raise CheckpointError(f"--resume {ref}: a job id needs the job's train.checkpoint_dir"
                                  " (set it in the job file), or give a checkpoint path")
        folder = job_folder(root, ref)
    else:
        folder = ref.rstrip("/")
        if _VERSION.match(posixpath.basename(folder)):
            return verify(folder)
    found = latest(folder, warn)
    if found is None:
        raise CheckpointError(f"--resume {ref}: no good checkpoint in {folder}")
    return found


def prune(folder: str, keep: int, spare: str | None = None) -> list[str]:
    """Delete all but the newest ``keep`` good versions (and torn or corrupt ones older than
    the newest good one), never the version folder ``spare``; the deleted paths."""
    fs, _ = fsspec.core.url_to_fs(folder)
    good: list[int] = []
    doomed: list[int] = []
    for version in reversed(versions(folder)):
        try:
            read_manifest(version_path(folder, version))
        except CheckpointError:
            if good:
                doomed.append(version)
            continue
        (good if len(good) < keep else doomed).append(version)
    kept = None if spare is None else fsspec.core.url_to_fs(spare)[1].rstrip("/")
    paths = [path for path in (version_path(folder, v) for v in doomed)
             if fsspec.core.url_to_fs(path)[1].rstrip("/") != kept]
    for path in paths:
        fs.rm(fsspec.core.url_to_fs(path)[1], recursive=True)
    return paths


def note(folder: str, progress: Mapping[str, Any]) -> None:
    """The master's note of the job's progress (``progress.json``), replaced atomically."""
    write(join(folder, PROGRESS), json.dumps(dict(progress), sort_keys=True).encode())


def read_note(folder: str) -> dict[str, Any] | None:
    """The job's last progress note, or None."""
    try:
        note: dict[str, Any] = json.loads(read(join(folder, PROGRESS)))
    except (FileNotFoundError, ValueError):
        return None
    return note


def check_fingerprint(manifest: Manifest, fingerprint: Mapping[str, str]) -> None:
    """Refuse to resume ``manifest`` with a job whose ``fingerprint`` differs, naming the key."""
    for key in sorted(set(manifest.fingerprint) | set(fingerprint)):
        old, new = manifest.fingerprint.get(key), fingerprint.get(key)
        if old != new:
            raise CheckpointError(f"cannot resume from {manifest.path}: {key} differs (the "
                                  f"checkpoint has {old!r}, the job has {new!r}); only "
                                  "learning rates and the number of workers may change")


def _read(path: str) -> bytes:
    try:
        return read(path)
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint file {path} is missing") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint file {path}: {exc}") from exc


def _file_digest(path: str) -> dict[str, Any]:
    """:func:`digest` of the file at ``path``, read in chunks."""
    hashed = hashlib.sha256()
    size = 0
    try:
        with fsspec.open(path, "rb") as f:
            while chunk := f.read(_CHUNK_BYTES):
                hashed.update(chunk)
                size += len(chunk)
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint file {path} is missing") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint file {path}: {exc}") from exc
    return {"bytes": size, "sha256": hashed.hexdigest()}


def _check(manifest: Manifest, name: str, data: bytes) -> None:
    _compare(manifest, name, digest(data))


def _compare(manifest: Manifest, name: str, found: Mapping[str, Any]) -> None:
    expected = manifest.files.get(name)
    if expected is None:
        raise CheckpointError(f"checkpoint {manifest.path}: its manifest lists no {name}")
    if found != expected:
        raise CheckpointError(
            f"checkpoint file {join(manifest.path, name)} is corrupt: {found['bytes']} bytes "
            f"with sha256 {found['sha256'][:12]}..., the manifest says {expected['bytes']} "
            f"bytes with sha256 {expected['sha256'][:12]}...")

"""A job's checkpoint folder (:mod:`antdt.jobs.checkpoints`): versions written atomically with a
manifest last, verified by size and checksum, torn or corrupt ones skipped for the previous one
with a warning naming them, old ones pruned, a resume reference resolved."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from antdt.errors import CheckpointError
from antdt.jobs import JobPlan, checkpoints
from antdt.jobs.checkpoints import Every, Manifest
from antdt.jobs.keeper import Checkpointer
from waits import until


def write_version(folder: Path, version: int, done: int) -> Manifest:
    """A checkpoint version as the master writes it: model, ledger, then the manifest."""
    path = checkpoints.version_path(str(folder), version)
    files = {checkpoints.MODEL: checkpoints.save_model(
                 checkpoints.join(path, checkpoints.MODEL), {"w": torch.full((4,), float(done))}),
             checkpoints.LEDGER: checkpoints.write(checkpoints.join(path, checkpoints.LEDGER),
                                                   f"ledger {done}".encode())}
    manifest = Manifest(job_id="job", version=version, path=path, created=0.0, files=files,
                        rows={"done": done, "trained": done}, step=version, run=None,
                        fingerprint={"data.schema": "digest a", "model.embedding_dim": "16"},
                        worker="w", write_s=0.1)
    checkpoints.write_manifest(manifest)
    return manifest


def test_a_version_round_trips(tmp_path: Path) -> None:
    written = write_version(tmp_path, 1, done=40)
    found = checkpoints.verify(written.path)
    assert found == written
    assert torch.equal(checkpoints.load_model(found)["w"], torch.full((4,), 40.0))
    assert checkpoints.load_ledger(found) == b"ledger 40"


def test_a_truncated_model_is_skipped_for_the_previous_checkpoint(tmp_path: Path) -> None:
    write_version(tmp_path, 1, done=40)
    newest = write_version(tmp_path, 2, done=80)
    model = Path(newest.model)
    model.write_bytes(model.read_bytes()[:100])  # a disk that lost the file's tail
    warnings: list[str] = []

    found = checkpoints.latest(str(tmp_path), warnings.append)

    assert found is not None and found.version == 1 and found.rows["done"] == 40
    assert len(warnings) == 1 and str(model) in warnings[0] and "corrupt" in warnings[0]
    with pytest.raises(CheckpointError, match="corrupt"):
        checkpoints.load_model(newest)


def test_a_torn_version_without_manifest_is_skipped(tmp_path: Path) -> None:
    write_version(tmp_path, 1, done=40)
    torn = Path(write_version(tmp_path, 2, done=80).path)
    (torn / checkpoints.MANIFEST).unlink()  # the master died before the manifest
    warnings: list[str] = []
    found = checkpoints.latest(str(tmp_path), warnings.append)
    assert found is not None and found.version == 1
    assert len(warnings) == 1 and str(torn) in warnings[0] and "incomplete" in warnings[0]


def test_a_flipped_byte_in_the_ledger_is_detected(tmp_path: Path) -> None:
    manifest = write_version(tmp_path, 1, done=40)
    ledger = Path(manifest.ledger)
    ledger.write_bytes(b"L" + ledger.read_bytes()[1:])  # same size, other content
    with pytest.raises(CheckpointError, match=f"{ledger}.*corrupt"):
        checkpoints.verify(manifest.path)
    assert checkpoints.latest(str(tmp_path), lambda _: None) is None


def test_prune_keeps_the_newest_good_versions(tmp_path: Path) -> None:
    for version in (1, 2, 3, 4):
        write_version(tmp_path, version, done=10 * version)
    torn = Path(write_version(tmp_path, 5, done=50).path)
    (torn / checkpoints.MANIFEST).unlink()
    deleted = checkpoints.prune(str(tmp_path), keep=2)
    assert sorted(Path(p).name for p in deleted) == ["v000001", "v000002"]
    assert checkpoints.versions(str(tmp_path)) == [3, 4, 5]  # a torn newest one may be in flight


def test_prune_spares_the_version_the_model_started_from(tmp_path: Path) -> None:
    """An agent of a model restarted from version 1 may still be loading it (one started late)
    when newer checkpoints of that model complete."""
    base = write_version(tmp_path, 1, done=10).path
    for version in (2, 3, 4):
        write_version(tmp_path, version, done=10 * version)
    deleted = checkpoints.prune(str(tmp_path), keep=1, spare=base + "/")
    assert sorted(Path(p).name for p in deleted) == ["v000002", "v000003"]
    assert checkpoints.versions(str(tmp_path)) == [1, 4]
    checkpoints.verify(base)


def test_resolve_a_job_id_a_job_folder_or_a_version(tmp_path: Path) -> None:
    folder = tmp_path / "job"
    write_version(folder, 1, done=40)
    newest = write_version(folder, 2, done=80)
    skipped: list[str] = []
    assert checkpoints.resolve("job", str(tmp_path), skipped.append).version == 2
    assert checkpoints.resolve(str(folder), None, skipped.append).version == 2
    assert checkpoints.resolve(newest.path.replace("v000002", "v000001"), None,
                               skipped.append).version == 1
    assert skipped == []
    with pytest.raises(CheckpointError, match="needs the job's train.checkpoint_dir"):
        checkpoints.resolve("job", None, skipped.append)
    with pytest.raises(CheckpointError, match=f"no good checkpoint in {tmp_path}/other"):
        checkpoints.resolve("other", str(tmp_path), skipped.append)


def test_a_changed_fingerprint_is_refused_by_name(tmp_path: Path) -> None:
    manifest = write_version(tmp_path, 1, done=40)
    checkpoints.check_fingerprint(manifest, dict(manifest.fingerprint))
    changed = {**manifest.fingerprint, "model.embedding_dim": "32"}
    with pytest.raises(CheckpointError, match=r"model.embedding_dim differs .*'16'.*'32'"):
        checkpoints.check_fingerprint(manifest, changed)


def test_the_progress_note_is_replaced_whole(tmp_path: Path) -> None:
    assert checkpoints.read_note(str(tmp_path)) is None
    checkpoints.note(str(tmp_path), {"state": "running", "rows": {"trained": 10}})
    checkpoints.note(str(tmp_path), {"state": "finished", "rows": {"trained": 20}})
    assert checkpoints.read_note(str(tmp_path)) == {"state": "finished", "rows": {"trained": 20}}
    assert json.loads((tmp_path / checkpoints.PROGRESS).read_text())["state"] == "finished"


@pytest.mark.parametrize("value, rows, seconds", [
    (1000, 1000, None), ("1000", 1000, None), ("30s", None, 30.0), ("1.5m", None, 90.0),
    ("2h", None, 7200.0)])
def test_every_reads_rows_or_a_duration(value: object, rows: int | None,
                                        seconds: float | None) -> None:
    assert Every.parse(value) == Every(rows=rows, seconds=seconds)


@pytest.mark.parametrize("value", [0, -5, True, "0s", "soon", 1.5, None, "10 rows"])
def test_every_refuses_anything_else_naming_it(value: object) -> None:
    with pytest.raises(CheckpointError, match=f"checkpoint_every: expected .*{value!r}"):
        Every.parse(value)


def test_a_checkpoint_starts_early_enough_to_complete_within_its_interval() -> None:
    plan = JobPlan(name="j", row_groups=[("a.parquet", 0, 10)], batch_rows=1, shard_rows=1,
                   checkpoint_dir="/nowhere", checkpoint_every="1000")
    keeper = Checkpointer("j", plan, write_model=None,  # type: ignore[arg-type]
                          log=lambda level, message: None)
    keeper.restart_interval(rows_trained=0)
    # at 1,000 rows/s the master looks again in 0.1 s: due once 900 rows are trained
    assert not keeper.due(899, samples_per_s=1000.0, next_look_s=0.1)
    assert keeper.due(900, samples_per_s=1000.0, next_look_s=0.1)
    keeper.seconds.append(0.5)  # the last checkpoint took 0.5 s to write: start 500 rows earlier
    assert keeper.due(400, samples_per_s=1000.0, next_look_s=0.1)
    assert not keeper.due(399, samples_per_s=1000.0, next_look_s=0.1)
    keeper.restart_interval(rows_trained=400)
    assert not keeper.due(799, samples_per_s=1000.0, next_look_s=0.1)


def test_a_checkpoint_completing_after_the_restart_chose_its_point_gets_no_manifest(
        tmp_path: Path) -> None:
    """The job's model restarts from version 1 while version 2 is still being written: when
    version 2's files arrive it is discarded (no manifest, nothing pruned), so the restart's
    point stays the newest and the next restart counts its replayed rows from it; a checkpoint
    started after the restart is kept."""
    plan = JobPlan(name="j", row_groups=[("a.parquet", 0, 10)], batch_rows=1, shard_rows=1,
                   checkpoint_dir=str(tmp_path), checkpoint_every="1000", checkpoint_keep=1)
    logged: list[str] = []

    async def scenario() -> tuple[Manifest | None, ...]:
        release = asyncio.Event()

        async def write_model(worker: str, path: str) -> dict[str, Any]:
            await release.wait()
            return {"files": {checkpoints.LEDGER: checkpoints.write(
                        checkpoints.join(path, checkpoints.LEDGER), b"ledger")},
                    "rows": {"done": 20, "trained": 20}}

        keeper = Checkpointer("j", plan, write_model, log=lambda level, m: logged.append(m))
        write_version(tmp_path / "j", 1, done=10)
        await keeper.open(rows_trained=10)
        keeper.take("w", rows_trained=20, step=2, run=None, extra={})
        await keeper.settle(timeout_s=0.0)  # the restart chooses version 1 meanwhile
        chosen = await keeper.latest()
        release.set()
        await until(lambda: any("v000002" in m for m in logged), "version 2's end")
        after = await keeper.latest()
        keeper.take("w", rows_trained=30, step=3, run=None, extra={})
        await keeper.close({"job_id": "j"})
        return chosen, after, await keeper.latest()

    chosen, after, later = asyncio.run(scenario())
    assert chosen is not None and chosen.version == 1
    assert after is not None and after.version == 1, "the late version 2 was made a checkpoint"
    assert any("discarded" in m and "v000002" in m for m in logged), logged
    assert later is not None and later.version == 3

"""Checkpoints and resume from the application's side: a ranking model restored from a
checkpoint scores exactly like the one that wrote it, and a job file that changed what the
checkpoint fixed (schema, data, model shape) is refused by the key's name."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any

import mlflow
import pytest
import torch
import yaml

from antdt.errors import CheckpointError
from antdt.jobs import checkpoints
from antdt.jobs.checkpoints import Manifest
from data.reader import ShardReader
from data.synth import SynthResult
from commands import ANTDT, antdt
from pipeline.bench.processes import DaskProcesses, wait_for_workers
from pipeline.job.config import load_job
from pipeline.training.cluster import job_spec, resume_point
from pipeline.training.local import iterate_batches, prepare_data
from pipeline.training.recipes import TrainerRecipe


def write_checkpoint(folder: Path, job_path: Path, job_id: str = "job-1") -> Manifest:
    """A checkpoint of the job at ``job_path`` as AntDT's master writes one (its fingerprint
    from the job's spec), holding a freshly built model."""
    job = load_job(job_path)
    spec = job_spec(job)
    data = prepare_data(job)
    trainer = TrainerRecipe(data.schema, job.model, job.train.optim, seed=0)(torch.device("cpu"))
    path = checkpoints.version_path(checkpoints.job_folder(str(folder), job_id), 1)
    files = {checkpoints.MODEL: checkpoints.save_model(
        checkpoints.join(path, checkpoints.MODEL), trainer.checkpoint_state())}
    manifest = Manifest(job_id=job_id, version=1, path=path, created=0.0, files=files,
                        rows={"done": 0, "trained": 0, "expected": spec.plan.rows}, step=0,
                        run=None, fingerprint=spec.plan.fingerprint, worker="-", write_s=0.0)
    checkpoints.write_manifest(manifest)
    return manifest


def ignore(warning: str) -> None:
    """A checkpoint being written looks torn to a poll: no warning wanted."""


def past_checkpoint(folder: str) -> tuple[Manifest, dict[str, Any]] | None:
    """The job's newest good checkpoint and its master's last progress note, once the note
    counts rows trained past that checkpoint (None before)."""
    manifest = checkpoints.latest(folder, ignore)
    note = checkpoints.read_note(folder)
    if manifest is None or note is None or \
            int(note["rows"]["trained"] or 0) <= manifest.rows["trained"]:
        return None
    return manifest, note


def edit(job_path: Path, change: dict[str, dict[str, object]]) -> None:
    raw = yaml.safe_load(job_path.read_text())
    for section, values in change.items():
        raw[section].update(values)
    job_path.write_text(yaml.safe_dump(raw))


def test_a_restored_model_scores_a_file_bit_identically(job_file: Path) -> None:
    job = load_job(job_file)
    data = prepare_data(job)
    recipe = TrainerRecipe(data.schema, job.model, job.train.optim, seed=0)
    trained = recipe(torch.device("cpu"))
    reader = ShardReader(data.schema)
    for batch in list(iterate_batches(reader, data.train[:2], 512))[:12]:
        trained.step(batch)
    folder = job_file.parent / "ckpt"
    model = checkpoints.save_model(str(folder / "model.pt"), trained.checkpoint_state())
    manifest = Manifest(job_id="j", version=1, path=str(folder), created=0.0,
                        files={checkpoints.MODEL: model}, rows={}, step=0, run=None,
                        fingerprint={}, worker="-", write_s=0.0)
    restored = dataclasses.replace(recipe, seed=99)(torch.device("cpu"))  # other weights
    restored.restore_state(checkpoints.load_model(manifest))

    validation = list(iterate_batches(reader, data.validation, 1024))
    for batch in validation:
        assert torch.equal(trained.train_step.predict(batch), restored.train_step.predict(batch))
    # the optimisers' state came back too: one more step changes both models alike
    more = next(iterate_batches(reader, data.train[2:3], 512))
    assert trained.step(more) == restored.step(more)
    assert torch.equal(trained.train_step.predict(validation[0]),
                       restored.train_step.predict(validation[0]))


def test_a_changed_schema_is_refused_by_its_key(job_file: Path, tiny_data: SynthResult,
                                                 tmp_path: Path) -> None:
    manifest = write_checkpoint(tmp_path / "checkpoints", job_file)
    schema = yaml.safe_load(Path(tiny_data.out, "schema.yaml").read_text())
    schema["sparse"][0]["num_embeddings"] *= 2  # a bigger table: valid data, another model
    changed = tmp_path / "schema.yaml"
    changed.write_text(yaml.safe_dump(schema))
    edit(job_file, {"data": {"schema": str(changed)},
                    "train": {"checkpoint_dir": str(tmp_path / "checkpoints")}})

    result = antdt("train", str(job_file), "--resume", manifest.job_id, cwd=tmp_path,
                   check=False)

    assert result.returncode == 2, result.stdout + result.stderr
    assert f"cannot resume from {manifest.path}: data.schema differs" in result.stderr
    assert "training" not in result.stderr  # refused before a cluster started


@pytest.mark.parametrize("change, key", [
    ({"model": {"over_arch": [32, 1]}}, "model.over_arch"),
    ({"train": {"epochs": 3}}, "train.epochs"),
    ({"train": {"sparse_optimizer": "adagrad"}}, "train.sparse_optimizer"),
    ({"data": {"train": "the first training day only"}}, "data.train"),
])
def test_what_the_checkpoint_fixed_may_not_change(job_file: Path, tmp_path: Path,
                                                  change: dict[str, dict[str, object]],
                                                  key: str) -> None:
    manifest = write_checkpoint(tmp_path, job_file)
    if "data" in change:
        change = {"data": {"train": load_job(job_file).data.train[0]}}
    edit(job_file, change)
    job = load_job(job_file)
    with pytest.raises(CheckpointError, match=f"{key} differs"):
        resume_point(job, job_spec(job), manifest.path)


def test_learning_rates_and_workers_may_change(job_file: Path, tmp_path: Path) -> None:
    manifest = write_checkpoint(tmp_path, job_file)
    edit(job_file, {"train": {"dense_lr": 0.5, "sparse_lr": 0.5, "workers": 5,
                              "sync_period": "0.5s", "checkpoint_dir": str(tmp_path)}})
    job = load_job(job_file)
    assert resume_point(job, job_spec(job), manifest.job_id) == manifest


def test_a_finished_job_is_not_resumed(job_file: Path, tmp_path: Path) -> None:
    manifest = write_checkpoint(tmp_path, job_file)
    checkpoints.note(str(Path(manifest.path).parent), {
        "job_id": manifest.job_id, "state": "finished", "run": {"run_id": "abc"}})
    job = load_job(job_file)
    with pytest.raises(CheckpointError, match="job job-1 finished; its model is in MLflow "
                                              "run abc"):
        resume_point(job, job_spec(job), manifest.path)


@pytest.mark.slow
@pytest.mark.parametrize("tables", ["replicated", "sharded"])
def test_a_job_resumes_after_its_scheduler_and_every_worker_were_killed(
        medium_job: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tables: str) -> None:
    """A job with checkpoints every 150,000 rows, whose two workers each pause after 35% of its
    rows until an event nobody sets (it cannot end before the kill). Once its master has noted
    rows trained past its newest complete checkpoint, the scheduler and every worker are
    SIGKILLed (all in-memory state gone); the scheduler is stopped from that check on, so the
    checkpoint and the note the resumed job reads are the ones checked. On a new scheduler
    (another port) with new workers, ``--resume JOB_ID`` finishes it in the same MLflow run: no
    row lost, exactly the rows trained past that checkpoint replayed, the AUC of an
    uninterrupted run. With sharded tables every host writes its own buckets into each
    checkpoint, and each draws its buckets from those parts on the new cluster."""
    every, workers, rows = 150_000, 2, 2 * 300_000
    # the master notes the job's progress 5x a second: between two checkpoints, notes of rows
    # trained past the first one (what the kill waits for) come several times, not once
    monkeypatch.setenv("DASK_ANTDT__JOBS__TICK", "200ms")
    edit(medium_job, {"train": {"checkpoint_dir": str(tmp_path / "checkpoints"),
                                "checkpoint_every": every}, "model": {"tables": tables}})
    gated = tmp_path / "gated.yaml"  # the same job, its workers paused past 70% of the rows
    raw = yaml.safe_load(medium_job.read_text())
    raw["faults"] = [{"worker": worker, "pause_until": "daily-never",
                      "pause_after_rows": rows * 35 // 100} for worker in range(workers)]
    gated.write_text(yaml.safe_dump(raw))
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    with DaskProcesses(first) as old:
        old.add_workers(workers)
        wait_for_workers(old.address, workers)
        baseline = json.loads(antdt("submit", str(medium_job), "--scheduler", old.address,
                                    "--json", cwd=tmp_path).stdout.splitlines()[-1])
        job = subprocess.Popen([ANTDT, "submit", str(gated), "--scheduler", old.address,
                                "--job-id", "daily", "--json"], cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        folder = checkpoints.job_folder(str(tmp_path / "checkpoints"), "daily")
        # workers and scheduler: nothing of the job survives
        manifest, noted = old.kill_when(lambda: past_checkpoint(folder),
                                        "rows trained past the newest checkpoint, noted by "
                                        "the master", timeout_s=240)
        job.kill()  # its client, following a job that is gone
        job.wait()
    skipped: list[str] = []  # the checkpoint being written at the kill is torn
    assert checkpoints.latest(folder, skipped.append) == manifest
    assert checkpoints.read_note(folder) == noted
    assert all(folder in warning for warning in skipped)  # each names the version it skips
    assert noted["state"] == "running" and noted["rows"]["done"] < rows
    assert (checkpoints.MODEL in manifest.files) == (tables == "replicated")  # else in parts

    with DaskProcesses(second) as new:
        assert new.address != old.address
        new.add_workers(workers)
        wait_for_workers(new.address, workers)
        result = antdt("submit", str(medium_job), "--scheduler", new.address, "--resume",
                       "daily", "--json", cwd=tmp_path)
    summary = json.loads(result.stdout.splitlines()[-1])
    resumed_from = checkpoints.latest(folder, ignore)

    assert f"resuming job daily from {manifest.path}" in result.stderr
    assert summary["job_id"] == "daily" and summary["rows_lost"] == 0
    assert summary["rows_trained"] == rows + summary["rows_retrained"]
    # its speed counts the rows trained after the resume, not the checkpoint's
    assert summary["samples_per_s"] * summary["train_s"] == pytest.approx(
        summary["rows_trained"] - manifest.rows["trained"])
    # the rows the lost job trained past its checkpoint, as its master last noted them
    replayed = noted["rows"]["trained"] - manifest.rows["trained"]
    assert summary["rows_replayed"] == replayed > 0
    assert summary["auc"] == pytest.approx(baseline["auc"], abs=0.01)
    run = mlflow.MlflowClient(load_job(medium_job).mlflow.tracking_uri).get_run(
        summary["run_id"])
    assert run.info.run_id == noted["run"]["run_id"]  # the same run went on
    assert run.info.status == "FINISHED" and run.data.tags["antdt.resumes"] == "1"
    assert run.data.tags["antdt.resumed_from"] == manifest.path
    assert run.data.metrics["rows_replayed"] == summary["rows_replayed"]
    assert run.data.metrics["train.resumes"] == 1  # the event, at the step it resumed
    assert resumed_from is not None and resumed_from.extra["resumes"] == 1

"""The model registry end to end: models trained by ``train_local`` on real Parquet with string,
list and null values, registered in a real MLflow store, promoted by scoring them as loaded
from the registry."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import mlflow
import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner
from mlflow import MlflowClient

from antdt.errors import DataError
from data.files import expand
from data.synth import MULTI_VALUED_FEATURE, STRING_FEATURE, SynthResult, generate
from models.evaluate import auc
from pipeline.cli.main import cli
from pipeline.job.config import JobConfig, load_job
from pipeline.job.report import JobSummary
from pipeline.tracking.registry import (CHAMPION, PREVIOUS, Decision, Outcome, RegistryError,
                                        data_window, fingerprint, promote, rollback)
from pipeline.training.local import train_local

MODEL = "ranker"


@pytest.fixture(scope="module")
def rich_data(tmp_path_factory: pytest.TempPathFactory) -> SynthResult:
    """Three days of 10,000 rows, one file a day, with the string feature ``S1`` and the
    list feature ``M1`` besides dense and sparse columns with nulls."""
    out = tmp_path_factory.mktemp("rich")
    return generate(str(out), rows=30_000, days=3, seed=3, row_group_rows=4096,
                    files_per_day=1, num_sparse=8, with_string=True, with_multi_valued=True)


@pytest.fixture(scope="module")
def rich_job(tmp_path_factory: pytest.TempPathFactory, rich_data: SynthResult) -> Path:
    """A local job over ``rich_data`` (two days to train, one to validate) that registers its
    model as ``ranker`` in a store of its own."""
    out = Path(rich_data.out)
    store = tmp_path_factory.mktemp("registry")
    job = {"name": "rich", "model": {"arch": "dlrm", "embedding_dim": 16},
           "data": {"train": [str(out / f"date=2026-11-0{day}") for day in (1, 2)],
                    "validation": str(out / "date=2026-11-03"), "schema": str(out / "schema.yaml")},
           "train": {"batch_size": 512},
           "mlflow": {"tracking_uri": f"sqlite:///{store / 'mlflow.db'}",
                      "registered_model": MODEL}}
    path = store / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@dataclass(frozen=True)
class Versions:
    """Three versions of ``ranker``: trained on one day, the same day with a learning rate of
    about 0 (worse), and two days for two epochs (better)."""

    job: JobConfig
    weak: JobSummary
    worse: JobSummary
    better: JobSummary

    @property
    def uri(self) -> str:
        assert self.job.mlflow.tracking_uri is not None
        return self.job.mlflow.tracking_uri


@pytest.fixture(scope="module")
def versions(rich_job: Path, rich_data: SynthResult) -> Versions:
    one_day = f"data.train={Path(rich_data.out) / 'date=2026-11-01'}"
    weak = train_local(load_job(rich_job, [one_day]))
    worse = train_local(load_job(rich_job, [one_day, "train.sparse_lr=1.0e-9",
                                            "train.dense_lr=1.0e-9"]))
    better = train_local(load_job(rich_job, ["train.epochs=2"]))
    return Versions(load_job(rich_job), weak, worse, better)


def test_training_registers_a_version_per_run(versions: Versions) -> None:
    summaries = (versions.weak, versions.worse, versions.better)
    assert [(s.registered_model, s.registered_version) for s in summaries] == \
        [(MODEL, "1"), (MODEL, "2"), (MODEL, "3")]
    client = MlflowClient(versions.uri)
    for summary in summaries:
        version = client.get_model_version(MODEL, str(summary.registered_version))
        assert version.run_id == summary.run_id
        run = client.get_run(summary.run_id)
        assert run.info.status == "FINISHED"
        assert run.data.tags["antdt.registered_version"] == summary.registered_version
    assert versions.worse.auc < versions.weak.auc < versions.better.auc
    assert f"registered {MODEL} version 3" in versions.better.lines()
    assert versions.better.to_dict()["registered_version"] == "3"


def test_a_version_carries_the_runs_figures_and_its_data_window(versions: Versions,
                                                                rich_data: SynthResult) -> None:
    client = MlflowClient(versions.uri)
    tags = client.get_model_version(MODEL, "1").tags
    run = client.get_run(versions.weak.run_id)
    for key in ("auc", "logloss", "samples_per_s", "wall_s"):
        assert float(tags[f"antdt.{key}"]) == pytest.approx(run.data.metrics[key])
    for key in ("rows_trained", "rows_lost", "rows_retrained", "rows_quarantined", "workers"):
        assert int(tags[f"antdt.{key}"]) == getattr(versions.weak, key)
    assert int(tags["antdt.rows_trained"]) == 10_000
    assert (tags["antdt.mode"], tags["antdt.job"]) == ("local", "rich")

    out = Path(rich_data.out)
    assert json.loads(tags["antdt.data.train"]) == [str(out / "date=2026-11-01")]
    assert json.loads(tags["antdt.data.validation"]) == [str(out / "date=2026-11-03")]
    assert (tags["antdt.data.train_files"], tags["antdt.data.validation_files"]) == ("1", "1")
    one_day = load_job(versions.job.source, [f"data.train={out / 'date=2026-11-01'}"])
    assert tags["antdt.data.fingerprint"] == data_window(one_day.data).fingerprint
    # the run has its window too, and the window is queryable
    assert run.data.tags["antdt.data.fingerprint"] == tags["antdt.data.fingerprint"]
    same_data = client.search_model_versions(
        f"name = '{MODEL}' and tags.`antdt.data.fingerprint` = '{tags['antdt.data.fingerprint']}'")
    assert sorted(v.version for v in same_data) == [1, 2]  # the worse one read the same files
    two_days = client.get_model_version(MODEL, "3").tags
    assert two_days["antdt.data.fingerprint"] != tags["antdt.data.fingerprint"]
    assert two_days["antdt.data.train_files"] == "2"


def test_the_fingerprint_follows_the_files(tmp_path: Path, rich_data: SynthResult) -> None:
    day = tmp_path / "date=2026-11-01"
    shutil.copytree(Path(rich_data.out) / "date=2026-11-01", day)
    files = expand(str(day))
    first = fingerprint({"train": files})
    assert fingerprint({"train": files}) == first
    os.utime(files[0], (0, 0))  # touched, not changed
    assert fingerprint({"train": files}) == first
    assert fingerprint({"validation": files}) != first  # the role counts

    table = pq.read_table(files[0])
    pq.write_table(table.slice(1), files[0], row_group_size=4096)  # one row fewer
    rewritten = fingerprint({"train": files})
    assert rewritten != first
    Path(files[0]).write_bytes(Path(files[0]).read_bytes()[:-10])  # a torn file still counts
    assert fingerprint({"train": files}) not in (first, rewritten)


def test_the_champion_moves_only_for_a_better_model(versions: Versions) -> None:
    client = MlflowClient(versions.uri)
    first = promote(MODEL, version=1, tracking_uri=versions.uri)
    assert first.outcome is Outcome.FIRST and first.champion is None
    assert first.candidate_score == pytest.approx(versions.weak.auc, abs=1e-4)
    assert client.get_model_version_by_alias(MODEL, CHAMPION).version == 1

    kept = promote(MODEL, version=2, tracking_uri=versions.uri)
    assert kept.outcome is Outcome.KEPT and not kept.promoted
    assert kept.champion == "1" and kept.rows == 10_000
    assert kept.candidate_score == pytest.approx(versions.worse.auc, abs=1e-4)
    assert kept.champion_score == pytest.approx(versions.weak.auc, abs=1e-4)
    assert kept.gain is not None and kept.gain < 0
    assert client.get_model_version_by_alias(MODEL, CHAMPION).version == 1
    tags = client.get_model_version(MODEL, "2").tags
    assert tags["antdt.promotion.decision"] == "kept"
    assert tags["antdt.promotion.champion_version"] == "1"
    assert float(tags["antdt.promotion.candidate_score"]) == kept.candidate_score
    assert float(tags["antdt.promotion.champion_score"]) == kept.champion_score
    validation = list(versions.job.data.validation)
    assert json.loads(tags["antdt.promotion.validation"]) == validation
    assert tags["antdt.promotion.validation_fingerprint"] == \
        fingerprint({"validation": expand(validation)})
    run = client.get_run(versions.worse.run_id)
    assert run.data.tags["antdt.promotion.decision"] == "kept"
    assert run.data.metrics["promotion.candidate.auc"] == kept.candidate_score
    assert run.data.metrics["promotion.champion.auc"] == kept.champion_score

    demanding = promote(MODEL, min_gain=1.0, tracking_uri=versions.uri)  # the newest: 3
    assert demanding.candidate == "3" and demanding.outcome is Outcome.KEPT
    assert demanding.gain is not None and 0 < demanding.gain < 1.0
    promoted = promote(MODEL, tracking_uri=versions.uri)
    assert promoted.outcome is Outcome.PROMOTED and promoted.champion == "1"
    assert client.get_model_version_by_alias(MODEL, CHAMPION).version == 3
    assert client.get_model_version(MODEL, "3").tags["antdt.promotion.decision"] == "promoted"

    again = promote(MODEL, tracking_uri=versions.uri)
    assert again.outcome is Outcome.ALREADY_CHAMPION and again.candidate_score is None
    assert "already the champion" in again.lines()[0]
    assert client.get_model_version(MODEL, "3").tags["antdt.promotion.decision"] == "promoted"
    by_logloss = promote(MODEL, version=1, metric="logloss", tracking_uri=versions.uri)
    assert by_logloss.outcome is Outcome.KEPT  # lower is better: the champion's is lower
    assert by_logloss.candidate_score is not None and by_logloss.champion_score is not None
    assert by_logloss.candidate_score > by_logloss.champion_score


def test_guards_hold_a_better_model_back_and_a_rollback_is_one_call(versions: Versions
                                                                     ) -> None:
    """After the test above: version 3 is the champion, version 1 was. A rollback swaps them
    (twice: back again); version 3, better on AUC, stays out while its calibration is off by
    more than the tolerance asked for, and takes the champion once it is within it."""
    client = MlflowClient(versions.uri)

    def alias(name: str) -> int:
        return int(client.get_model_version_by_alias(MODEL, name).version)

    assert (alias(CHAMPION), alias(PREVIOUS)) == (3, 1)
    assert rollback(MODEL, versions.uri) == ("3", "1")
    assert (alias(CHAMPION), alias(PREVIOUS)) == (1, 3)
    held = promote(MODEL, version=3, no_worse=["logloss"], calibration=1e-9,
                   tracking_uri=versions.uri)
    assert held.outcome is Outcome.KEPT and held.gain is not None and held.gain > 0
    assert held.held_back == "calibration" and held.guards["logloss"]["ok"]
    ratio = held.guards["calibration"]["candidate"]
    assert not held.guards["calibration"]["ok"] and ratio != 1.0
    assert "(held back: calibration)" in held.lines()[-1]
    assert client.get_model_version(MODEL, "3").tags["antdt.promotion.held_back"] == \
        "calibration"
    assert alias(CHAMPION) == 1
    taken = promote(MODEL, version=3, no_worse=["logloss"], calibration=abs(ratio - 1) + 0.01,
                    tracking_uri=versions.uri)
    assert taken.outcome is Outcome.PROMOTED and taken.held_back is None
    assert (alias(CHAMPION), alias(PREVIOUS)) == (3, 1)
    result = CliRunner().invoke(cli, ["promote", MODEL, "--rollback", "--tracking-uri",
                                      versions.uri])
    assert result.exit_code == 0, result.output
    assert "the champion is version 1 again (was 3" in result.output
    assert rollback(MODEL, versions.uri) == ("1", "3")


def test_the_champion_loaded_by_alias_scores_raw_rows(rich_job: Path) -> None:
    job = load_job(rich_job, ["mlflow.registered_model=serving"])
    summary = train_local(job)
    assert job.mlflow.tracking_uri is not None
    assert promote("serving", tracking_uri=job.mlflow.tracking_uri).promoted
    mlflow.set_tracking_uri(job.mlflow.tracking_uri)
    model = mlflow.pyfunc.load_model("models:/serving@champion")
    validation = expand(list(job.data.validation))
    assert len(validation) == 1
    frame = pq.read_table(validation[0]).to_pandas()
    labels = frame.pop("label").to_numpy()
    assert frame[STRING_FEATURE].map(lambda v: isinstance(v, str)).any()
    assert frame[MULTI_VALUED_FEATURE].map(lambda v: v is not None and len(v) > 1).any()
    scores = model.predict(frame)
    assert scores.shape == (len(frame),)
    assert ((scores > 0) & (scores < 1)).all()
    assert auc(labels, scores) == pytest.approx(summary.auc, abs=1e-4)

    # nulls in every kind of column: dense, integer ids, strings, lists
    holes = frame.head(64).copy()
    for column in ("I1", "C1"):  # pandas spells a null number NaN
        holes[column] = holes[column].astype(np.float64)
        holes.loc[holes.index[::2], column] = np.nan
    for column in (STRING_FEATURE, MULTI_VALUED_FEATURE):
        holes.loc[holes.index[::2], column] = None
    patched = model.predict(holes)
    assert patched.shape == (64,) and np.isfinite(patched).all()
    assert ((patched > 0) & (patched < 1)).all()
    assert not np.allclose(patched[::2], scores[:64:2])  # the nulls reached the model
    assert np.allclose(patched[1::2], scores[1:64:2], atol=1e-6)


def test_cli_trains_registers_and_promotes(job_file: Path) -> None:
    job = load_job(job_file)
    result = CliRunner().invoke(cli, ["train", str(job_file), "--local",
                                      "--register", "cli-ranker"])
    assert result.exit_code == 0, result.output
    assert "registered cli-ranker version 1" in result.stdout
    assert "antdt promote cli-ranker --version 1" in result.stdout

    result = CliRunner().invoke(cli, ["promote", "cli-ranker", "--json",
                                      "--tracking-uri", str(job.mlflow.tracking_uri)])
    assert result.exit_code == 0, result.output
    decision = json.loads(result.stdout.strip().splitlines()[-1])
    assert decision["outcome"] == "first" and decision["promoted"] is True
    assert decision["candidate"] == "1" and decision["champion"] is None
    assert decision["rows"] == 20_000 and 0.5 < decision["candidate_score"] < 1

    result = CliRunner().invoke(cli, ["promote", "cli-ranker", "--on",
                                      ",".join(job.data.validation),
                                      "--tracking-uri", str(job.mlflow.tracking_uri)])
    assert result.exit_code == 0, result.output
    assert "cli-ranker version 1 is already the champion" in result.stdout


def test_bad_input_is_refused_in_one_line(versions: Versions, tmp_path: Path,
                                          job_file: Path) -> None:
    uri = versions.uri
    for args, expected in (
            (["promote", "nope", "--tracking-uri", uri], "no registered model 'nope'"),
            (["promote", MODEL, "--version", "9", "--tracking-uri", uri], "no version 9"),
            (["promote", MODEL, "--version", "2", "--metric", "accuracy", "--tracking-uri", uri],
             "metric 'accuracy'"),
            (["promote", MODEL, "--version", "2", "--on", str(tmp_path / "missing"),
              "--tracking-uri", uri], str(tmp_path / "missing")),
            (["train", str(job_file), "--local", "--register", "a/b"], "'a/b'"),
            (["train", str(job_file), "--local", "--register", "ann's"], "a quote")):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2, (args, result.output)
        assert expected in result.output
        assert "Traceback" not in result.output
    with pytest.raises(DataError, match="missing"):
        promote(MODEL, version=2, on=[str(tmp_path / "missing")], tracking_uri=uri)
    with pytest.raises(RegistryError, match="min_gain"):
        promote(MODEL, min_gain=-0.1, tracking_uri=uri)


@pytest.mark.parametrize("decision", [
    Decision("ranking", "2", "1", Outcome.KEPT, "auc", 0.61, 0.64, 0.001,
             ("/d/date=2026-11-03/part-0.parquet",), 12_000, "ab" * 32),
    Decision("ranking", "1", None, Outcome.FIRST, "logloss", 0.52, None, 0.0, ("/d",), 10, "cd"),
    Decision("ranking", "4", "3", Outcome.KEPT, "auc", 0.66, 0.64, 0.0, ("/d",), 10, "ef",
             {"calibration": {"candidate": 1.2, "champion": 1.01, "ok": False}},
             "calibration"),
])
def test_a_decision_reads_back_from_its_tags(decision: Decision) -> None:
    """What a re-run reports of a day judged before (pipeline.workflows.retrain) is the decision
    recorded then."""
    assert Decision.from_tags(decision.model, decision.candidate, decision.tags()) == decision
    assert Decision.from_tags("ranking", "3", {"antdt.job": "tiny"}) is None

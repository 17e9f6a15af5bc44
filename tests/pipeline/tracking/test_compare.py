"""``antdt compare`` over real MLflow stores of real (tiny) training runs: a local SQLite store,
and a live ``mlflow server``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result
from mlflow import MlflowClient
from PIL import Image

from data.synth import SynthResult
from pipeline.cli.main import cli
from pipeline.job.config import load_job
from pipeline.job.report import JobSummary
from pipeline.tracking.compare import compare, plot
from pipeline.training.local import train_local

JOB = """\
name: tiny
data: {{train: ["{out}/date=2026-11-01", "{out}/date=2026-11-02"],
        validation: "{out}/date=2026-11-03", schema: "{out}/schema.yaml"}}
model: {{arch: dlrm, embedding_dim: 8, dense_arch: [16, 8], over_arch: [16, 1]}}
train: {{batch_size: 512, epochs: 1, seed: 0, log_every: 10}}
mlflow: {{experiment: tests, tracking_uri: "{uri}"}}
"""
"""The ``job_file`` fixture's job, written once for the module's store."""


@dataclass(frozen=True)
class Store:
    """A store of three tiny local runs: ``base``; ``lr-0.1`` (another ``train.sparse_lr``);
    ``one-day`` (batches of 1,024 over one day of the two: half the rows). The last two are
    the trials of a sweep's parent run ``parent``."""

    uri: str
    job: Path
    runs: dict[str, JobSummary]
    parent: str


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, tiny_data: SynthResult) -> Store:
    folder = tmp_path_factory.mktemp("compare")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    job = folder / "job.yaml"
    job.write_text(JOB.format(out=tiny_data.out, uri=uri))
    base = train_local(load_job(job), run_name="base")
    client = MlflowClient(uri)
    parent = client.create_run(base.experiment_id, run_name="sweep",
                               tags={"antdt.sweep": "parent"}).info.run_id
    trial = {"mlflow.parentRunId": parent}
    runs = {"base": base,
            "lr-0.1": train_local(load_job(job, ["train.sparse_lr=0.1"]), tags=trial,
                                  run_name="lr-0.1"),
            "one-day": train_local(load_job(job, ["train.batch_size=1024",
                                                  f"data.train=[{tiny_data.out}/date=2026-11-01]"]),
                                   tags=trial, run_name="one-day")}
    client.set_terminated(parent)
    return Store(uri=uri, job=job, runs=runs, parent=parent)


def antdt(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def compared(store: Store, *args: str) -> list[dict]:
    result = antdt("compare", "--tracking-uri", store.uri, "--json", *args)
    assert result.exit_code == 0, result.output
    return list(json.loads(result.stdout))


def test_json_lists_the_runs_their_differing_params_the_best_and_the_rows(store: Store) -> None:
    shown = compared(store, "--experiment", "tests")

    # without --experiment: the experiment of the store's newest run
    assert compared(store) == shown
    # the sweep's parent is not a run of its own; best AUC first
    assert {run["name"] for run in shown} == set(store.runs)
    aucs = [run["metrics"]["auc"] for run in shown]
    assert aucs == sorted(aucs, reverse=True)
    best = max(store.runs, key=lambda name: store.runs[name].auc)
    assert [run["name"] for run in shown if "auc" in run["best"]] == [best]
    # only what differs: shard_rows is 8 x batch_size, so it differs with it
    assert {key for run in shown for key in run["params"]} == {
        "data.train", "train.batch_size", "train.shard_rows", "train.sparse_lr"}
    by_name = {run["name"]: run for run in shown}
    assert by_name["lr-0.1"]["params"]["train.sparse_lr"] == "0.1"
    assert by_name["one-day"]["params"]["train.batch_size"] == "1024"
    for name, summary in store.runs.items():
        run = by_name[name]
        assert run["run_id"] == summary.run_id
        assert (run["status"], run["mode"], run["workers"]) == ("FINISHED", "local", 1)
        assert run["rows"] == {"trained": summary.rows_trained, "lost": 0, "retrained": 0,
                               "quarantined": 0, "replayed": 0}
        assert run["metrics"]["auc"] == pytest.approx(summary.auc)
    # the run that saw half the data is called out, the others are not
    assert store.runs["one-day"].rows_trained * 2 == store.runs["base"].rows_trained
    assert {name: by_name[name]["data_issues"] for name in store.runs} == {
        "base": [], "lr-0.1": [], "one-day": ["fewer_rows_trained"]}


def test_table_shows_the_differing_params_and_the_legend(store: Store) -> None:
    result = antdt("compare", "--tracking-uri", store.uri, "--experiment", "tests",
                   "--metric", "logloss")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = "".join(lines[:next(i for i, line in enumerate(lines) if "┡" in line)])
    for key in ("train.sparse_lr", "train.batch_size", "data.train"):
        assert key in header
    assert "train.seed" not in result.stdout and "sweep" not in result.stdout
    assert "best logloss first (lower is better)" in result.stdout
    one_day = next(line for line in result.stdout.splitlines() if "one-day" in line)
    assert f"{store.runs['one-day'].rows_trained:,} !" in one_day
    legend = result.stdout.strip().splitlines()[-1]
    assert legend.startswith("* best of these runs   ! data differs: fewer rows trained than "
                             f"the most here ({store.runs['base'].rows_trained:,})")


def test_plot_draws_every_run_bar_and_curve(store: Store, tmp_path: Path) -> None:
    path = tmp_path / "out" / "compare.png"
    result = antdt("compare", "--tracking-uri", store.uri, "--experiment", "tests",
                   "--plot", str(path))
    assert result.exit_code == 0, result.output
    image = np.asarray(Image.open(path).convert("RGB"))
    assert image.shape[1] == 1400 and 400 <= image.shape[0] <= 1000
    # each run's bar and curve in its own colour (tab10's first three, best AUC first)
    for colour in ((31, 119, 180), (255, 127, 14), (44, 160, 44)):
        assert (np.abs(image.astype(int) - colour).sum(axis=2) < 30).sum() > 500, colour

    plotted = plot(compare(store.uri, experiment="tests"), str(tmp_path / "again.png"))
    labels = {f"{name} ({summary.run_id[:8]})" for name, summary in store.runs.items()}
    assert set(plotted.bars) == set(plotted.curves) == labels
    assert plotted.no_curve == () and plotted.series == "train.loss"
    # a metric with a series of its own plots that series
    assert plot(compare(store.uri, experiment="tests", metric="samples_per_s"),
                str(tmp_path / "speed.png")).series == "train.samples_per_s"


def test_a_parent_run_stands_for_its_children(store: Store) -> None:
    base, trial, other = (store.runs[name].run_id for name in ("base", "lr-0.1", "one-day"))
    shown = compared(store, "--runs", store.parent)
    assert [run["run_id"] for run in shown] == [trial, other]  # the order they started
    assert set(shown[0]["params"]) == {"data.train", "train.batch_size", "train.shard_rows",
                                       "train.sparse_lr"}
    # as given, not ranked; a run named again (here as a child too) is shown once
    given = compared(store, "--runs", f"{other},{base},{store.parent}")
    assert [run["run_id"] for run in given] == [other, base, trial]


@pytest.mark.parametrize(("args", "named"), [
    (["--runs", "0123456789abcdef0123456789abcdef"], "'0123456789abcdef0123456789abcdef'"),
    (["--experiment", "nope"], "no experiment 'nope'"),
    (["--experiment", "tests", "--metric", "acu"], "no shown run has the metric 'acu'"),
    (["--runs", "x", "--last", "3"], "leave out --experiment and --last"),
])
def test_bad_input_is_one_line_naming_it(store: Store, args: list[str], named: str) -> None:
    result = antdt("compare", "--tracking-uri", store.uri, *args)
    assert result.exit_code == 2
    assert named in result.output and "Traceback" not in result.output


def test_no_runs_and_no_store_are_said_plainly(store: Store, tmp_path: Path) -> None:
    MlflowClient(store.uri).create_experiment("empty", artifact_location=str(tmp_path))
    result = antdt("compare", "--tracking-uri", store.uri, "--experiment", "empty")
    assert result.exit_code == 0
    assert result.stdout.startswith("no runs in experiment 'empty'")
    assert compared(store, "--experiment", "empty") == []

    missing = tmp_path / "elsewhere" / "mlflow.db"
    result = antdt("compare", "--tracking-uri", f"sqlite:///{missing}")
    assert result.exit_code == 2 and f"{missing} does not exist" in result.output
    assert not missing.parent.exists()


@pytest.mark.slow
def test_compare_against_a_live_mlflow_server(mlflow_server: str, store: Store) -> None:
    served = [train_local(load_job(store.job, [f"mlflow.tracking_uri={mlflow_server}"]),
                          run_name=f"served-{i}") for i in range(2)]
    result = antdt("compare", "--tracking-uri", mlflow_server, "--experiment", "tests", "--json")
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert {run["run_id"] for run in shown} == {summary.run_id for summary in served}
    assert all(run["rows"]["trained"] == served[0].rows_trained for run in shown)
    result = antdt("compare", "--tracking-uri", mlflow_server, "--runs", "f" * 32)
    assert result.exit_code == 2 and "f" * 32 in result.output


def test_a_run_started_from_another_shows_where_it_started(tiny_data: SynthResult,
                                                          tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(out=tiny_data.out, uri=uri))
    base = train_local(load_job(job), run_name="base")
    following = train_local(load_job(job, [f"train.init_from=runs:/{base.run_id}"]),
                            run_name="next")
    result = antdt("compare", "--tracking-uri", uri, "--json", "--runs",
                   f"{base.run_id},{following.run_id}")
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert [run["started_from"] for run in shown] == [None, f"run {base.run_id[:8]}"]
    table = antdt("compare", "--tracking-uri", uri, "--runs", f"{base.run_id},{following.run_id}")
    lines = table.stdout.splitlines()
    header = "".join(lines[:next(i for i, line in enumerate(lines) if "┡" in line)])
    assert "from" in header and f"run {base.run_id[:8]}" in table.stdout

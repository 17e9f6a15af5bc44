"""What a person sees: ``antdt train`` in a real process (a LocalCluster of worker processes,
MLflow, TorchRec) prints its progress bar and its summary and nothing else; ``-v`` shows the
libraries' logs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rich.table import Table

from pipeline.job.report import JobSummary
from pipeline.terminal import QUIET_ENVIRONMENT, print_whole

ANTDT = str(Path(sys.executable).parent / "antdt")
BAR = re.compile(r"^training \((async|local)\) .*\d+/\d+ +\d+:\d\d:\d\d +(\d+:\d\d:\d\d|-:--:--)$")
"""The progress bar's final line as rich prints it when stderr is not a terminal."""


RUN_S = 240.0
"""How long one command may run (less than the test's own timeout: a command that hangs fails
its test with the stacks of its threads)."""


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``antdt ARGS`` as a person's shell runs it: none of our quiet settings inherited. One
    that runs past :data:`RUN_S` is stopped with SIGABRT, its threads' stacks (Python's fault
    handler) in the test's failure."""
    env = {k: v for k, v in os.environ.items()
           if k not in QUIET_ENVIRONMENT and not k.startswith("DASK_LOGGING__")}
    with subprocess.Popen([ANTDT, *args], cwd=cwd, env={**env, "PYTHONFAULTHANDLER": "1"},
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=RUN_S)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)
            stdout, stderr = process.communicate(timeout=60)
            pytest.fail(f"antdt {' '.join(args)} ran past {RUN_S:g}s; its stderr, with its "
                        f"threads' stacks:\n{stderr[-20_000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def summary_lines(stdout: str) -> list[str]:
    return stdout.rstrip("\n").split("\n")


@pytest.mark.slow
def test_train_shows_the_bar_and_the_summary_and_nothing_else(cluster_job: Path,
                                                               tmp_path: Path) -> None:
    result = run(["train", str(cluster_job), "--workers", "2"], cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    page, *bar = [line for line in result.stderr.split("\n") if line.strip()]
    # where the job can be watched, then the bar
    assert re.fullmatch(r"job page: http://127\.0\.0\.1:\d+/antdt/jobs/small-[0-9a-f]{8}", page), \
        result.stderr
    assert bar and all(BAR.match(line) for line in bar), result.stderr
    lines = summary_lines(result.stdout)
    assert re.fullmatch(r"run [0-9a-f]{32} \(async, 2 workers\)", lines[0]), lines
    assert [line.split()[0] for line in lines[1:6]] == ["AUC", "logloss", "rows", "speed",
                                                        "control"]
    # the next steps: MLflow's UI on the job's own store, the run's page, the timeline PNG
    run_id = lines[0].split()[1]
    store = f"sqlite:///{cluster_job.parent / 'mlflow.db'}"
    assert lines[6:] == [
        "", "next", f"  the run   mlflow ui --backend-store-uri {store}",
        f"            then open http://127.0.0.1:5000/#/experiments/1/runs/{run_id}",
        lines[-1]]
    timeline = Path(lines[-1].removeprefix("  timeline  "))
    assert timeline.name == "timeline.png" and run_id in timeline.parts
    assert (tmp_path / timeline).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


EXIT_WITH_A_POOL = """
import sys
from concurrent.futures import ThreadPoolExecutor
from pipeline.cli.main import main
POOL = ThreadPoolExecutor(1)  # a library's pool, kept by a global: its worker waits idle
POOL.submit(int).result()
sys.argv = ["antdt", "--help"]
main()
"""


def test_the_command_leaves_though_a_librarys_thread_pool_waits_idle() -> None:
    """MLflow keeps thread pools in globals; a pool's idle worker ends only when the
    interpreter's exit tells it to (``antdt -v train`` once waited for one for ever)."""
    done = subprocess.run([sys.executable, "-c", EXIT_WITH_A_POOL], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert done.returncode == 0 and "Usage: antdt" in done.stdout, done.stderr


@pytest.mark.slow
def test_verbose_shows_the_libraries_logs(job_file: Path, tmp_path: Path) -> None:
    loud = run(["-v", "train", str(job_file), "--local"], cwd=tmp_path)

    assert loud.returncode == 0, loud.stderr
    # MLflow creates the job's fresh store and says so at INFO; torch warns about fx tracing
    assert "mlflow" in loud.stderr and "is_fx_tracing" in loud.stderr
    assert loud.stdout.startswith("run ")


def test_the_next_steps_name_a_server_run_page_and_hide_a_password() -> None:
    summary = JobSummary(run_id="r1", mode="local", workers=1, auc=0.8, logloss=0.4,
                         oracle_auc=None, rows_trained=1, rows_lost=0, rows_retrained=0,
                         rows_quarantined=0, wall_s=1.0, samples_per_s=1.0,
                         tracking_uri="http://ann:***@mlflow.example:5000", experiment_id="7")
    assert summary.lines()[-3:] == [
        "", "next", "  the run   open http://ann:***@mlflow.example:5000/#/experiments/7/runs/r1"]
    assert "tracking_uri" in summary.to_json() and "experiment_id" not in summary.metrics()


def test_a_table_printed_to_a_pipe_is_never_folded(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Piped (``antdt status | grep``), a table is as wide as its longest row needs, not 80
    columns, so every row stays on one line; the lines of text beside it stay whole too."""
    monkeypatch.delenv("COLUMNS", raising=False)
    table = Table(title="antdt jobs")
    for column in ("job", "name", "state", "MLflow run", "submitted"):
        table.add_column(column)
    rows = [(f"job-{i}-{'x' * 20}", "ranking-daily", "running", f"{i:032x}",
             "2026-11-27 14:00:00") for i in range(3)]
    for row in rows:
        table.add_row(*row)
    line = "; ".join(["rows done 1,000/2,000 (epoch 0: 1,000)"] * 4)
    print_whole(line, table)
    shown = capsys.readouterr().out.splitlines()
    assert shown[0] == line
    for row in rows:
        assert [text for text in shown if row[0] in text and row[3] in text], (row, shown)
    assert max(map(len, shown)) > 80

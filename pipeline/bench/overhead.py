"""`antdt bench overhead`: where a user waits. ``antdt train`` as a person runs it, from the
command to its exit, in each mode, next to the peer a TorchRec user would run instead: torchrun
and :mod:`pipeline.bench.peer` (``DistributedModelParallel``, a static split), on the same job.

Every leg is a command in a process of its own, timed from outside (``wall_s``: spawn to exit),
and reports its seconds of training (``train_s``, the summary's); ``outside_s = wall_s -
train_s`` is what the user waits for besides the training. antdt's legs also report their
``phases`` (:mod:`pipeline.job.phases`, ``exit`` added: the summary's end to the process's).
Legs:

* ``async``, ``sync``: ``antdt train JOB --mode M --workers W`` (a LocalCluster it starts);
* ``local``: ``antdt train JOB --local``;
* ``submit``: ``antdt train JOB --scheduler ADDR`` (what ``antdt submit`` and follow do) on a
  long-lived cluster of ``dask scheduler`` and ``dask worker`` processes started beforehand,
  whose workers already trained a job (the cluster's start is not the job's);
* ``peer``: ``torchrun --nproc-per-node W -m pipeline.bench.peer JOB``.

The job: ``--rows`` synthetic rows over 7 days (the demo's layout: 4 files a day, row groups of
65,536 rows), the last day validating; DLRM, one epoch. The sync mode, the local mode and the peer
step on the global batch ``RANK_BATCH x W``; the async mode's workers each step on
``RANK_BATCH`` rows (a rank's share), as the straggler benchmark runs them. ``--tree DIR`` adds
the antdt legs run from another checkout (``before async`` ...: a change's before and after in
one sitting). Legs interleave, ``--repeats`` times; figures are medians.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import yaml

from pipeline.bench import emit, median_of
from pipeline.bench.jobs import echo
from pipeline.bench.processes import DaskProcesses, wait_for_workers

RANK_BATCH = 4096
"""Rows of one rank's (one async worker's) step."""

MODES = ("async", "sync", "local", "submit", "peer")


def job_file(folder: Path, rows: int, workers: int, tracking_uri: str) -> Path:
    """The benchmark's job file in ``folder``, its data synthesised there once."""
    from data.synth import generate

    data = folder / f"synthetic-{rows}"
    if not (data / "oracle.json").exists():
        generate(str(data), rows=rows, days=7, seed=0)
    days = sorted(d.name for d in data.iterdir() if d.name.startswith("date="))
    path = folder / f"overhead-{rows}.yaml"
    path.write_text(yaml.safe_dump({
        "name": "overhead",
        "data": {"train": [str(data / d) for d in days[:-1]],
                 "validation": str(data / days[-1]), "schema": str(data / "schema.yaml")},
        "model": {"arch": "dlrm", "embedding_dim": 16},
        "train": {"batch_size": RANK_BATCH * workers, "epochs": 1, "seed": 0,
                  "workers": workers, "adaptive_batch": False},
        "mlflow": {"experiment": "antdt-bench-overhead", "tracking_uri": tracking_uri},
    }, sort_keys=False))
    return path


def argv_of(leg: str, job: Path, workers: int, address: str | None) -> list[str]:
    """The command line of ``leg`` (its ``before`` prefix dropped)."""
    mode = leg.rpartition(" ")[2]
    if mode == "peer":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(workers), "-m", "pipeline.bench.peer", str(job),
                "--json"]
    antdt = [str(Path(sys.executable).parent / "antdt"), "train", str(job), "--json"]
    if mode == "local":
        return [*antdt, "--local"]
    if mode == "submit":
        return [*antdt, "--scheduler", str(address), "--set",
                f"train.batch_size={RANK_BATCH}"]
    batch = ["--set", f"train.batch_size={RANK_BATCH}"] if mode == "async" else []
    return [*antdt, "--mode", mode, "--workers", str(workers), *batch]


def run_leg(leg: str, argv: list[str], env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """One run of ``leg``: its wall seconds from outside (until the command's process exited,
    as a shell waits for it: its output goes to files, which processes it leaves behind may
    hold a moment longer) and what its JSON line says."""
    with tempfile.TemporaryFile("w+") as out_file, tempfile.TemporaryFile("w+") as err_file:
        started = time.time()
        code = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out_file,
                                stderr=err_file).wait()
        wall = time.time() - started
        out_file.seek(0)
        err_file.seek(0)
        stdout, stderr = out_file.read(), err_file.read()
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if code != 0 or not lines:
        raise click.ClickException(f"{leg}: {' '.join(argv)} exited {code}:\n{stderr[-3000:]}")
    out = json.loads(lines[-1])
    phases = dict(out.get("phases") or {})
    if "total_s" in phases:  # they count from the process's start, a few ms after the spawn
        phases["exit"] = round(wall - phases["total_s"], 3)
    return {"wall_s": round(wall, 3), "train_s": round(float(out["train_s"]), 3),
            "samples_per_s": round(float(out["samples_per_s"]), 1),
            "auc": out.get("auc"), "phases": phases}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A leg's medians over its runs."""
    def med(values: list[float]) -> float:
        return round(median_of(values), 3)

    steps = {step for run in runs for step in run["phases"]}
    return {"wall_s": med([r["wall_s"] for r in runs]),
            "train_s": med([r["train_s"] for r in runs]),
            "outside_s": med([r["wall_s"] - r["train_s"] for r in runs]),
            "samples_per_s": med([r["samples_per_s"] for r in runs]),
            "auc": med([r["auc"] for r in runs]),
            "phases": {step: med([r["phases"][step] for r in runs if step in r["phases"]])
                       for step in sorted(steps)},
            "runs_wall_s": [r["wall_s"] for r in runs]}


@click.command("overhead")
@click.option("--rows", type=click.IntRange(min=10_000), default=1_300_000, show_default=True,
              help="Synthetic rows over 7 days; 6 train (1.3M: a 1.1M-row job).")
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--modes", default=",".join(MODES), show_default=True,
              help=f"Legs to run, of {', '.join(MODES)}.")
@click.option("--repeats", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--tree", "trees", multiple=True, type=click.Path(exists=True, file_okay=False),
              help="Another checkout whose antdt legs run too: the first labelled 'before', "
                   "others by their folder's name.")
@click.option("--folder", type=click.Path(file_okay=False), default=".antdt-bench",
              show_default=True, help="Where the data, job file and MLflow store go.")
@click.option("--json", "as_json", is_flag=True)
def command(rows: int, workers: int, modes: str, repeats: int, trees: tuple[str, ...],
             folder: str, as_json: bool) -> None:
    """A job's fixed cost: `antdt train` from the command to its exit, by phase, in each mode,
    against torchrun and a DistributedModelParallel peer on the same job."""
    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = sorted(set(chosen) - set(MODES))
    if unknown:
        raise click.BadParameter(f"{unknown}: expected some of {', '.join(MODES)}",
                                 param_hint="--modes")
    base = Path(folder).resolve()
    base.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{base / 'overhead-mlflow.db'}"
    job = job_file(base, rows, workers, uri)
    from mlflow import MlflowClient

    MlflowClient(uri).search_experiments()  # the store made before any leg is timed
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    legs: dict[str, tuple[list[str], dict[str, str]]] = {}
    labels = ["before"] + [Path(t).name for t in trees[1:]]
    with tempfile.TemporaryDirectory(prefix="antdt-overhead-") as scratch:
        cluster = None
        if "submit" in chosen:
            cluster = DaskProcesses(Path(scratch))
            cluster.add_workers(workers)
            wait_for_workers(cluster.address, workers)
        try:
            address = None if cluster is None else cluster.address
            for mode in chosen:  # torchrun warns of OMP_NUM_THREADS unless it is set
                legs[mode] = (argv_of(mode, job, workers, address),
                              {**env, "OMP_NUM_THREADS": "1"} if mode == "peer" else env)
            for label, tree in zip(labels, trees):
                tree_env = {**env, "PYTHONPATH": str(Path(tree).resolve())}
                for mode in chosen:  # the long-lived cluster runs this tree's code
                    if mode not in ("peer", "submit"):
                        legs[f"{label} {mode}"] = (argv_of(mode, job, workers, address),
                                                   tree_env)
            if cluster is not None:  # its workers import the stack once, before any timing
                run_leg("submit (warm-up)", *legs["submit"], cwd=base)
            runs: dict[str, list[dict[str, Any]]] = {leg: [] for leg in legs}
            for repeat in range(repeats):
                for leg, (argv, leg_env) in legs.items():
                    echo(f"overhead: {leg}, run {repeat + 1} of {repeats}", as_json)
                    runs[leg].append(run_leg(leg, argv, leg_env, base))
        finally:
            if cluster is not None:
                cluster.close()
    result: dict[str, Any] = {"rows": rows, "workers": workers, "repeats": repeats,
                              "rank_batch": RANK_BATCH,
                              "legs": {leg: summarise(r) for leg, r in runs.items()}}
    result["ratios"] = ratios(result["legs"])
    emit(result, as_json)


def ratios(legs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each antdt leg's wall and samples/s over the peer's, and its outside seconds over the
    same mode's from the other tree (``before``)."""
    out: dict[str, float] = {}
    peer = legs.get("peer")
    for leg, figures in legs.items():
        if leg == "peer":
            continue
        if peer is not None:
            out[f"{leg} wall / peer"] = round(figures["wall_s"] / peer["wall_s"], 3)
            out[f"{leg} samples/s / peer"] = round(
                figures["samples_per_s"] / peer["samples_per_s"], 3)
        before = legs.get(f"before {leg}")
        if before is not None:
            out[f"{leg} outside / before"] = round(figures["outside_s"] / before["outside_s"], 3)
    return out


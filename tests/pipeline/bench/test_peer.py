"""The torchrun peer (:mod:`pipeline.bench.peer`): run as a user runs it, two ranks under
``torch.distributed.run``, it trains every training row of the job once per epoch in lock-step
and evaluates the gathered model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data.files import RowGroup, expand, row_groups
from pipeline.bench.peer import batches_of, share
from pipeline.job.config import load_job
from waits import CALL_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[3]


def test_the_ranks_shares_cover_every_row_once_in_batches_that_span_row_groups() -> None:
    groups = [RowGroup("a", 0, 7), RowGroup("a", 1, 3), RowGroup("b", 0, 11)]
    shares = [share(groups, rank, 3) for rank in range(3)]
    rows = [[(s.group, i) for s in spans for i in range(s.start, s.stop)] for spans in shares]
    assert [len(r) for r in rows] == [7, 7, 7]
    assert sum(rows, []) == [(g, i) for g in groups for i in range(g.num_rows)]
    batches = list(batches_of(shares[0], 4))  # rank 0: rows 0-6 of a/0
    assert [sum(s.stop - s.start for s in b) for b in batches] == [4, 3]
    spanning = list(batches_of(shares[1], 4))  # a/1 rows 0-2, then b/0 rows 0-3
    assert [[(s.group.index, s.start, s.stop) for s in b] for b in spanning] == \
        [[(1, 0, 3), (0, 0, 1)], [(0, 1, 4)]]


def test_the_peer_trains_every_row_on_two_ranks_and_scores_the_model(job_file: Path) -> None:
    job = load_job(str(job_file))
    train_rows = sum(g.num_rows for g in row_groups(expand(list(job.data.train))))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "pipeline.bench.peer", str(job_file), "--set", "train.epochs=2", "--json"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=CALL_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["rows"] == 2 * train_rows
    assert summary["world"] == 2
    assert summary["auc"] > 0.5 and summary["logloss"] > 0
    assert summary["samples_per_s"] == pytest.approx(summary["rows"] / summary["train_s"],
                                                     rel=1e-2)
    assert set(summary["phases"]) == {"imports_s", "group_s", "train_s", "evaluate_s"}
    assert 0 < summary["phases"]["imports_s"] < summary["process_start_to_train_s"]

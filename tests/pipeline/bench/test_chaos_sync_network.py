"""A synchronous job whose links are cut (:mod:`pipeline.bench.chaos_partitions`: a cluster of
hosts in network namespaces), audited on its final model: one seeded run of each partition (the
worker cut from everyone twice, healed once the scheduler dropped it and once its process
exited). The group breaks at the collective timeout and forms again, as on a death; the job
finishes with every row in its final model exactly once per epoch, and the rows it trained
twice, by its ranks' step logs, are the rows its master counts replayed."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.bench.chaos import chaos
from pipeline.bench.network import namespaces_available

WHY_NOT = namespaces_available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")

JOB_S = 3.0
"""The size of a run's job (rows from a nominal rate, not a measured speed)."""

RUNS = [("partition", 2, "dropped", True), ("partition", 5, "exited", False),
        ("peer-partition", 6, None, False), ("scheduler-partition", 0, None, True)]
"""Each run's scenario, its seed, and what the seed draws: when ``partition`` heals, and whether
the models are written in parts."""


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("scenario", "seed", "heal", "parts"), RUNS)
def test_a_sync_job_whose_links_are_cut_forms_its_group_again_and_loses_no_row(
        scenario: str, seed: int, heal: str | None, parts: bool, tmp_path: Path) -> None:
    result = chaos(0, seed=seed, folder=tmp_path, scenarios=(scenario,), job_s=JOB_S,
                   mode="sync")
    (run,) = result["runs"]
    brief = {key: run[key] for key in ("state", "error", "heal", "partitions", "generation",
                                       "discrepancies", "seconds")}
    assert (run["scenario"], run["heal"], run["parts"]) == (scenario, heal, parts), brief
    assert run["finished"], brief
    assert run["discrepancies"] == 0, brief
    assert run["partitions"] == 1 and run["generation"] >= 2, brief  # it formed again
    (job,) = run["jobs"]
    assert job["rows_checked"] == job["rows"]["expected"] == job["rows"]["done"], job
    assert job["rows_replayed"] == job["trained_twice"], job

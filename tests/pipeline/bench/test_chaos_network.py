"""The async chaos runs on a network that fails (:mod:`pipeline.bench.chaos_net`), one seeded run
each, audited on the final model: a worker cut from everyone and healed before anyone noticed
(it rejoins its work: nothing of it is trained again), inside the zombie window (the scheduler
removed it; what it sends then is refused and counted) and after its process exited; every
worker cut from the scheduler for a moment and until the scheduler dropped them all (the job
resumes from its checkpoint on the workers that start again). Every row is in the final model
exactly once per epoch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.bench.chaos import run_scenario
from pipeline.bench.network import namespaces_available

WHY_NOT = namespaces_available()
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}"),
              pytest.mark.timeout(600)]


def audited(run: dict[str, Any]) -> None:
    assert run["finished"], run
    assert run["discrepancies"] == 0, run
    assert run["rows_checked"] == run["rows"]["expected"] == run["rows"]["done"], run


def test_a_zombie_is_refused_and_its_rows_are_trained_once_elsewhere(tmp_path: Path) -> None:
    run = run_scenario("partition", 0, tmp_path, 8.0, heal="zombie")
    audited(run)
    assert run["heal"] == "zombie"
    assert sum(run["refused"].values()) > 0, run  # it spoke after its removal, and was refused
    assert run["rows"]["retrained"] > 0  # what it trained unsynced was trained again


@pytest.mark.slow
@pytest.mark.parametrize("heal", ["early", "exited"])
def test_a_worker_cut_off_and_healed_early_or_after_its_exit(
        heal: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if heal == "early":  # healed before anyone judged it: a worker is hung only after 10 s
        # without a commit here (the chaos runs': 2 s, which a cut's rounds may last on a
        # machine as busy as this one, every peer's held up to its pull timeout)
        monkeypatch.setenv("DASK_ANTDT__MONITOR__HANG_FLOOR", "10s")
    run = run_scenario("partition", 0, tmp_path, 8.0, heal=heal)
    audited(run)
    if heal == "early":  # it went on where it was: nothing of it was trained again or refused
        assert run["rows"]["retrained"] == 0 and run["refused"] == {} and run["resumes"] == 0, run


@pytest.mark.slow
@pytest.mark.parametrize("heal", ["short", "dropped"])
def test_the_scheduler_cut_off_from_every_worker(
        heal: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if heal == "short":  # a worker is hung after 10 s without a commit here, not 2 s: its
        # silence counts the blip, and on a busy machine one may commit again seconds after
        # the others (docs/partitions.md)
        monkeypatch.setenv("DASK_ANTDT__MONITOR__HANG_FLOOR", "10s")
    run = run_scenario("scheduler-partition", 0, tmp_path, 8.0, heal=heal)
    audited(run)
    assert run["resumes"] == (1 if heal == "dropped" else 0), run
    if heal == "short":  # a blip of the scheduler's link: no worker retired, nothing lost
        assert run["rows"]["retrained"] == 0 and run["refused"] == {}, run

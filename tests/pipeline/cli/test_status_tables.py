"""``antdt status JOB_ID`` of a job whose tables are sharded: where its buckets are and what each
trainer saw of them."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from pipeline.cli.jobs import job_details


def record(tables: dict[str, Any] | None) -> dict[str, Any]:
    worker = {"label": "worker0", "worker": "tcp://a:1", "state": "running", "rows": 4096,
              "samples_per_s": 1000.0, "health": "normal", "batch_rows": None,
              "tables": {"pull_ms": 3.25, "push_ms": 7.5, "inflight": 1}}
    return {"job_id": "j-1", "name": "j", "mode": "async", "state": "running",
            "submitted_at": 0.0, "started_at": 1.0, "ended_at": None, "rows": {},
            "run": None, "checkpoint": None, "error": None, "stopped": None,
            "workers": [worker], "actions_total": 0, "actions": [], "batch_rows": 512,
            "tables": tables}


def text(parts: list[Any]) -> str:
    console = Console(width=200, record=True)
    for part in parts:
        console.print(part)
    return console.export_text()


def test_status_says_where_the_buckets_are_and_what_the_trainer_saw() -> None:
    tables = {"rows": 1_000_000, "buckets": 16, "epoch": 3, "moves": 4, "lost": [],
              "departed": [], "held": {"tcp://a:1": {"primary": 8, "backup": 8}}}
    shown = text(job_details(record(tables)))
    assert "tables sharded: 1,000,000 rows in 16 buckets (map epoch 3, 4 copied)" in shown
    assert "8+8" in shown and "3.2" in shown and "7.5" in shown
    assert "LOST" in text(job_details(record({**tables, "lost": [2]})))
    assert "buckets" not in text(job_details(record(None)))  # replicated: no such columns

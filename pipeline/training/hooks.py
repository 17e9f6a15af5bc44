"""The application's side of a cluster job (:class:`antdt.jobs.JobHooks`), run in tasks on
workers: the job's MLflow run (tagged with its data window when it starts), its metrics, the
evaluation, logging and registration of the final model, and the summary a person reads.

What travels to the workers is this small picklable object: the job's config (its tracking URI
resolved where the job was submitted, the registered model's name if any), its schema and its
validation row groups. MLflow and the plotting are imported only by the tasks that use them,
never by an agent.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from antdt.watch.urls import redact_all
from data.files import RowGroup
from data.schema import Schema
from pipeline.job.config import JobConfig
from pipeline.job.phases import StepClock
from pipeline.job.report import JobSummary, oracle_auc
from pipeline.tracking.tracking import public_config


@dataclass(frozen=True)
class RankingHooks:
    """Tracking and evaluation of one ranking-model job (see the module docstring).

    ``tracking_uri`` is the store the workers write to and ``experiment_id`` the run's
    experiment in it (both resolved where the job was submitted); ``quarantine`` the bad units
    of the training files, logged with the run; ``run_tags`` and ``run_name`` what the run
    starts with besides antdt's own (a sweep's trial: its parent run and its values)."""

    job: JobConfig
    schema: Schema
    validation: list[RowGroup]
    example: RowGroup
    tracking_uri: str
    experiment_id: str
    quarantine: list[tuple[str, int | None, str]]
    run_tags: Mapping[str, str] = dataclasses.field(default_factory=dict)
    run_name: str | None = None

    def start(self, job_id: str, workers: int, resume: Mapping[str, Any] | None = None
              ) -> dict[str, Any]:
        from pipeline.tracking.registry import data_window
        from pipeline.tracking.tracking import Tracker

        # the run records the workers that train (the cluster's), not the job file's count
        tracked = dataclasses.replace(self.job, train=dataclasses.replace(
            self.job.train, workers=workers))
        if resume is not None:
            tracker = Tracker.reopen(self.tracking_uri, resume["run"])
            tracker.resumed(public_config(tracked), checkpoint=str(resume["checkpoint"]),
                            resumes=int(resume["resumes"]),
                            rows_replayed=int(resume["rows_replayed"]),
                            step=int(resume["step"]))
            return tracker.info()
        data_tags = data_window(self.job.data).tags()  # the files as training starts to read them
        tracker = Tracker.start(tracked, mode=self.job.train.mode,
                                tags={**data_tags, **self.run_tags, "antdt.job_id": job_id},
                                tracking_uri=self.tracking_uri,
                                experiment_id=self.experiment_id, run_name=self.run_name)
        tracker.artifact_yaml(self.schema.to_dict(), "schema.yaml")
        if self.quarantine:
            tracker.artifact_yaml([list(q) for q in self.quarantine], "quarantine.yaml")
        return tracker.info()

    def metrics(self, run: Mapping[str, Any],
                steps: Sequence[tuple[int, dict[str, float]]]) -> None:
        from pipeline.tracking.tracking import Tracker

        Tracker.attach(self.tracking_uri, run).steps(steps)

    def finish(self, run: Mapping[str, Any], trainer: Any,
               report: Mapping[str, Any]) -> dict[str, Any]:
        """Evaluate the consensus model (None: the job stopped early, or its ranks wrote it in
        parts, ``report["saved_model"]``; AUC nan), log the final counters, the controller's
        actions, the timeline and the model, registered when the job names a registered model,
        or where its parts are (tag ``antdt.model_dir``, artifact ``model_parts.yaml``: each
        file's size and sha256); return the summary."""
        from pipeline.tracking.registry import logging_model
        from pipeline.tracking.tracking import Tracker

        clock = StepClock()
        tracker = Tracker.attach(self.tracking_uri, run)
        if trainer is None:
            summary = self._record(tracker, report, math.nan, math.nan, clock)
            tracker.end("FINISHED")
        else:  # the model is logged beside the evaluation; the run ends with it
            with logging_model(tracker, trainer.train_step, self.schema, self.job,
                               example=self.example) as registered:
                auc, logloss = self._evaluate(trainer)
                clock.lap("evaluate")
                summary = registered(self._record(tracker, report, auc, logloss, clock))
        clock.lap("model")
        return dataclasses.replace(summary, phases=clock.laps).to_dict()

    def _evaluate(self, trainer: Any) -> tuple[float, float]:
        """AUC and log loss of ``trainer``'s model on the validation rows."""
        from data.reader import ShardReader
        from models.evaluate import evaluate
        from pipeline.training.local import iterate_batches

        metrics = evaluate(trainer.train_step.predict, iterate_batches(
            ShardReader(self.schema), self.validation, self.job.train.batch_size))
        return metrics["auc"], metrics["logloss"]

    def _record(self, tracker: Any, report: Mapping[str, Any], auc: float, logloss: float,
                clock: StepClock) -> JobSummary:
        """The job's summary, logged to its run with the final counters, the controller's
        actions, where a model in parts is, and the timeline."""
        from pipeline.tracking.timeline import ActionMark, LeaseSpan, render_timeline

        rows = report["rows"]
        agents = report["agents"]
        saved = report.get("saved_model")
        train_s = float(report["train_s"])
        summary = JobSummary(
            run_id=tracker.run_id, mode=self.job.train.mode, workers=len(agents), auc=auc, logloss=logloss,
            oracle_auc=oracle_auc(self.job.data.schema, [g.path for g in self.validation]),
            rows_trained=rows["trained"], rows_lost=rows["lost"],
            rows_retrained=rows["retrained"], rows_quarantined=rows["quarantined"],
            wall_s=float(report["wall_s"]), train_s=train_s,
            samples_per_s=report["rows_trained_here"] / max(train_s, 1e-9),
            straggler_actions=len(report["actions"]), tracking_uri=tracker.tracking_uri,
            rows_replayed=int(report.get("rows_replayed", 0)),
            experiment_id=tracker.experiment_id,
            timeline=tracker.artifact_location("timeline.png"), adapted=report.get("adapted"),
            model_dir=None if saved is None else str(saved["folder"]))
        tracker.summary({k: v for k, v in summary.metrics().items() if not math.isnan(v)})
        tracker.summary({f"ledger.{'' if k.startswith('epoch') else 'rows_'}{k}": v
                         for k, v in rows.items() if isinstance(v, int)})
        tracker.summary(agent_metrics(agents))
        tracker.summary(checkpoint_metrics(report.get("checkpoints") or {}))
        if report["actions"]:
            tracker.artifact_yaml(list(report["actions"]), "straggler_actions.yaml")
        if report["stopped"] is not None:
            tracker.tag("antdt.stopped", report["stopped"])
        if summary.adapted is not None:
            tracker.tag("antdt.adapted", summary.adapted)
        if saved is not None:
            tracker.tag("antdt.model_dir", str(saved["folder"]))
            tracker.artifact_yaml(redact_all(dict(saved)), "model_parts.yaml")
        clock.lap("metrics")
        spans = [LeaseSpan(**span) for span in report["spans"]]
        marks = [ActionMark(**mark) for mark in report["marks"]]
        with tempfile.TemporaryDirectory(prefix="antdt-timeline-") as folder:
            tracker.artifact_file(render_timeline(
                spans, marks, f"{folder}/timeline.png",
                title=f"{self.job.name} ({report['job_id']}, {len(agents)} agents, "
                      f"sharding {report['sharding']})"))
        clock.lap("timeline")
        return summary

    def abort(self, run: Mapping[str, Any], status: str, reason: str) -> None:
        from pipeline.tracking.tracking import Tracker

        Tracker.attach(self.tracking_uri, run).end(status, reason)


def checkpoint_metrics(checkpoints: Mapping[str, Any]) -> dict[str, float]:
    """How many checkpoints the job's last master wrote, the last one's size, the median write
    time (nothing when it wrote none)."""
    seconds = sorted(checkpoints.get("seconds") or [])
    if not seconds:
        return {}
    return {"checkpoints.written": checkpoints["written"],
            "checkpoints.bytes": checkpoints["bytes"],
            "checkpoints.write_s_median": seconds[len(seconds) // 2]}


def agent_metrics(agents: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Final per-agent figures (rows, batches, busy seconds and the training thread's CPU
    seconds in them, sync exchanges and the seconds training waited for them, mean loss) and
    the agents' fates (dead, started on a worker that joined mid-job)."""
    out: dict[str, float] = {"agents_dead": sum(bool(a["dead"]) for a in agents),
                             "agents_joined": sum(bool(a["join"]) for a in agents)}
    for agent in agents:
        if agent["batches"] is None:
            continue
        name = agent["label"]
        out[f"{name}.rows"] = agent["rows"]
        out[f"{name}.batches"] = agent["batches"]
        out[f"{name}.busy_s"] = agent["busy_s"]
        out[f"{name}.cpu_s"] = agent["cpu_s"]
        out[f"{name}.sync_exchanges"] = agent["exchanges"]
        if agent.get("sync_wait_s") is not None:
            out[f"{name}.sync_wait_s"] = agent["sync_wait_s"]
        if agent["loss"] is not None:
            out[f"{name}.loss"] = agent["loss"]
    return out

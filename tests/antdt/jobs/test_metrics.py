"""A job's metrics on their way to its tracking run (:class:`MetricsShipper`), with a virtual
clock and made-up tasks: no cluster."""

from __future__ import annotations

from typing import Any

from antdt.jobs.metrics import MetricsShipper, Step

RUN = {"run_id": "r1"}


class Task:
    """A metrics task as the shipper sees it: pending until the test says otherwise."""

    def __init__(self, steps: list[Step], worker: str | None) -> None:
        self.steps, self.worker = steps, worker
        self.status, self.key, self.released = "pending", f"metrics-{steps[0][0]}", False

    def done(self) -> bool:
        return self.status != "pending"

    def release(self) -> None:
        self.released = True


class Rig:
    def __init__(self) -> None:
        self.now = 0.0
        self.tasks: list[Task] = []
        self.workers = {"tcp://a", "tcp://b"}
        self.logged: list[tuple[str, str]] = []
        self.shipper = MetricsShipper(lambda: self.now, 5.0, self._submit,
                                      self.workers.__contains__,
                                      lambda level, message: self.logged.append((level,
                                                                                 message)))

    def _submit(self, run: Any, steps: list[Step], worker: str | None) -> Task:
        assert run == RUN
        self.tasks.append(Task(steps, worker))
        return self.tasks[-1]

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.shipper.add({"train.rows_done": float(self.shipper.step)})


def test_steps_go_in_one_task_per_interval_once_the_run_is_open() -> None:
    rig = Rig()
    rig.steps(2)
    rig.shipper.tick(None)  # no run yet: kept
    rig.now = 1.0
    rig.shipper.tick(RUN)  # within the interval of the last look
    assert rig.tasks == []
    rig.now = 6.0
    rig.shipper.tick(RUN)
    assert [t.steps for t in rig.tasks] == [[(0, {"train.rows_done": 0.0}),
                                             (1, {"train.rows_done": 1.0})]]
    assert rig.tasks[0].worker is None and rig.shipper.step == 2


def test_one_task_at_a_time_and_a_failed_one_is_logged_and_released() -> None:
    rig = Rig()
    rig.steps(1)
    rig.shipper.send(RUN)
    rig.steps(2)
    rig.shipper.send(RUN)  # the first one is on its way
    assert len(rig.tasks) == 1 and not rig.shipper.settled()
    rig.tasks[0].status = "error"
    rig.shipper.check()
    assert rig.tasks[0].released and rig.shipper.settled()
    assert rig.logged == [("warning", "metrics did not reach the tracking run (see the "
                                      "worker's log for task metrics-0)")]
    rig.shipper.send(RUN)
    assert [s for s, _ in rig.tasks[1].steps] == [1, 2]


def test_tasks_stay_on_the_hooks_worker_and_go_again_when_it_left() -> None:
    rig = Rig()
    rig.shipper.hooks_on = "tcp://a"
    rig.steps(2)
    rig.shipper.send(RUN)
    assert rig.tasks[0].worker == "tcp://a"
    rig.steps(1)
    rig.workers.discard("tcp://a")
    assert rig.shipper.settled()  # nothing to wait for on a worker that left
    rig.shipper.check()
    assert rig.tasks[0].released and rig.shipper.hooks_on is None
    rig.shipper.send(RUN)
    assert rig.tasks[1].worker is None
    assert [s for s, _ in rig.tasks[1].steps] == [0, 1, 2]  # the lost task's steps first


def test_a_resumed_job_numbers_its_steps_on() -> None:
    rig = Rig()
    rig.shipper.step = 40
    rig.steps(1)
    rig.shipper.send(RUN)
    assert rig.tasks[0].steps == [(40, {"train.rows_done": 40.0})]

"""How a synchronous rank fails cleanly, on a real gloo group of one rank in this process: it
leaves its process group whatever broke (the group formed again on its worker is not refused),
one group per worker process holds without a race, a checkpoint its asker gave up on is still
written at the step boundary, and a final model written in parts replaces the folder whole."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from antdt.agent import AgentSpec
from antdt.agent.modes.synchronous import PROCESS_GROUP, GroupBroken, SyncMode, publish
from antdt.errors import CheckpointError
from waits import bounded


class Parts:
    """A :class:`~antdt.agent.modes.synchronous.ShardedTrainer` of one rank: its model is kept
    in parts (one file), or gathered; its gather can be made to fail as a dead peer's would."""

    rank = 0
    world_size = 1

    def __init__(self, parts: bool, gather_fails: bool = False) -> None:
        self.parts = parts
        self.gather_fails = gather_fails

    def step(self, batch: Any, global_rows: int) -> float:
        return 0.0

    def batch(self, parts: Sequence[Any]) -> Any:
        return list(parts)

    def gather_refusal(self, dst: int) -> str | None:
        return "kept in parts" if self.parts else None

    def full_state(self, dst: int) -> Any:
        if self.gather_fails:
            raise RuntimeError("Connection closed by peer")
        return {"w": torch.zeros(1)}

    def write_shards(self, folder: str) -> dict[str, dict[str, Any]]:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "part-0").write_bytes(b"rank 0")
        return {"part-0": {"bytes": 6, "sha256": "-"}}

    def restore_state(self, state: Any) -> None:
        pass

    def final(self, state: Any) -> Any:
        return state

    def plan_summary(self) -> Mapping[str, str]:
        return {}

    def state_bytes(self) -> int:
        return 6


class Shards:
    def flush(self) -> None:
        pass


class Agent:
    shards = Shards()


@pytest.fixture
def rank(tmp_path: Path) -> Iterator[SyncMode]:
    """Rank 0 of a group of one (gloo, a file store), claimed as job ``j``'s, as
    :meth:`SyncMode.start` leaves it."""
    assert PROCESS_GROUP.claim("j") is None
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=30))
    mode = SyncMode(AgentSpec(job="j", batch_rows=4, mode="sync", sync_period=None,
                              model_dir=str(tmp_path / "model")), None,  # type: ignore[arg-type]
                    torch.device("cpu"), None)  # type: ignore[arg-type]
    mode._joined = True
    try:
        yield mode
    finally:
        mode.leave()
        if dist.is_initialized():
            dist.destroy_process_group()
        PROCESS_GROUP.release("j")


def test_a_rank_whose_final_gather_breaks_leaves_its_group(rank: SyncMode) -> None:
    """The final gather fails (a peer died in it): the rank raises :class:`GroupBroken` and
    has left the process group, so the group formed again on this worker can claim it. (It
    used to raise before leaving: the worker's next forming was refused, "already takes part
    in a process group", and the job failed.)"""
    rank.trainer = Parts(parts=False, gather_fails=True)
    rank.group_rows = 96
    with pytest.raises(GroupBroken, match="gathering the final model failed") as broken:
        rank.finish()
    assert broken.value.group_rows == 96
    assert not dist.is_initialized()
    assert PROCESS_GROUP.claim("j2") is None
    PROCESS_GROUP.release("j2")


def test_one_group_per_process_is_claimed_by_one_job_at_a_time() -> None:
    """Two jobs' ranks starting at once on one worker: exactly one claims the process group,
    the other is told which job holds it; the claim goes with its holder's release only. The
    claims granted are counted (a group formed again frees the last one's model first)."""
    claims = PROCESS_GROUP.claims
    won: list[str | None] = []
    start = threading.Barrier(8)

    def claim(job: str) -> None:
        start.wait()
        won.append(PROCESS_GROUP.claim(job))

    threads = [threading.Thread(target=claim, args=(f"job{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert won.count(None) == 1 and PROCESS_GROUP.claims == claims + 1
    holder = PROCESS_GROUP.job
    assert holder is not None and all(w in (None, holder) for w in won)
    PROCESS_GROUP.release("someone else")
    assert PROCESS_GROUP.claim("late") == holder
    PROCESS_GROUP.release(holder)
    assert PROCESS_GROUP.job is None


def test_a_checkpoint_its_asker_gave_up_on_is_written_at_the_boundary(rank: SyncMode,
                                                                       tmp_path: Path) -> None:
    """The step's header flagged the request (the training thread read it), then the asking
    thread gave up waiting for the boundary: at the boundary the rank still takes part in the
    checkpoint's collectives with the request it read (its folder goes to every rank) and
    training goes on; the asker got a :class:`CheckpointError`. (The boundary used to read
    the request again, found none, sent no folder and failed every rank on an ``assert``.)"""
    rank.trainer = Parts(parts=True)
    rank._timeout_s = 0.2
    folder = tmp_path / "v000001"
    failed: list[BaseException] = []

    def ask() -> None:
        try:
            rank.checkpoint(lambda: {"ledger": b""}, str(folder))
        except CheckpointError as exc:
            failed.append(exc)

    asker = threading.Thread(target=ask)
    asker.start()
    request = bounded.until(lambda: rank._request, "the checkpoint request")
    asker.join()
    assert failed and "reached no step boundary" in str(failed[0])
    assert rank._request is None
    rank._checkpoint(Agent(), 0, request)  # type: ignore[arg-type]
    assert request.done.is_set() and request.result is not None
    assert (folder / "part-0").read_bytes() == b"rank 0"


def test_a_final_model_in_parts_replaces_the_folder_whole(tmp_path: Path) -> None:
    """A group formed again after a finish wrote part of the model: the new group's parts
    (another world size) replace the old folder, none of the old files stays beside them."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "part-0-of-3").write_text("old")
    (model / "dense.pt").write_text("old")
    stale = tmp_path / "model.1a2b"
    stale.mkdir()
    (stale / "part-0-of-2").write_text("half written")
    new = tmp_path / "model.3c4d"
    new.mkdir()
    (new / "part-0-of-2").write_text("new")
    (new / "dense.pt").write_text("new")
    publish(str(new), str(model))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert {p.name: p.read_text() for p in model.iterdir()} == {"part-0-of-2": "new",
                                                                "dense.pt": "new"}

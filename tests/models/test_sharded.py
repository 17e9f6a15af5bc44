"""ShardedTrainStep on real gloo groups of spawned ranks: a split global batch trains exactly like
the whole batch in one process, checkpoints move between world sizes and to a plain TrainStep
(gathered, or written by every rank and loaded on any number of ranks), and a plan that cannot
fit is refused with the sizes."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from data.schema import Schema
from models.config import ModelConfig, OptimConfig
from models.sharded import read_train_step, to_train_step
from models.shards import read_full_state
from models.train_step import TrainStep, model_bytes
from models.warm import STATE_FILE, job_shapes, plan, source_shapes
from ranks import Ranks
from sharded_ranks import (ADAGRAD, SGD, WIDE, assert_states_close, batch, gather_refusals, warmed,
                           loaded, make_rows, refusal, train, write_failure, written)
from small_model import CPU, SCHEMA, SMALL

pytestmark = pytest.mark.slow

TABLES = {name: f"sparse_arch.embedding_bag_collection.embedding_bags.{name}.weight"
          for name in SCHEMA.sparse_names}


@pytest.fixture(scope="module")
def ranks() -> Iterator[Ranks]:
    """Three ranks for the whole module: the tests use groups of their first 1, 2 or 3."""
    with Ranks(3) as pool:
        yield pool


def plain_run(model_cfg: ModelConfig, optim_cfg: OptimConfig,
              sizes: list[int]) -> tuple[list[dict[str, Any]], list[float]]:
    """A single-process TrainStep's states (before, then after each step) and losses on the
    global batches ``make_rows(i, sizes[i])``."""
    step = TrainStep(SCHEMA, model_cfg, optim_cfg, device=CPU, seed=0)
    states, losses = [step.state_dict()], []
    for i, size in enumerate(sizes):
        losses.append(step.step(batch(make_rows(i, size))))
        states.append(step.state_dict())
    return states, losses


def test_a_split_batch_trains_like_the_whole_batch(ranks: Ranks) -> None:
    splits = [(4, 4), (2, 6), (0, 8)]
    expected, plain_losses = plain_run(SMALL, SGD, [8, 8, 8])
    for split in splits:
        rank0, rank1, _ = ranks.run(train, 2, [split] * 3, SMALL, SGD)
        # the same initial model as TrainStep's, then the same parameters after every step
        assert_states_close(rank0.states[0], expected[0], rtol=0.0)
        for after, plain in zip(rank0.states[1:], expected[1:]):
            assert_states_close(after, plain, where=str(split))
        assert rank1.states == [None] * 4
        for i, plain_loss in enumerate(plain_losses):
            local = [rank0.losses[i], rank1.losses[i]]
            if split[0] == 0:
                assert math.isnan(local[0])
                assert local[1] == pytest.approx(plain_loss, abs=1e-6)
            else:
                assert sum(n * loss for n, loss in zip(split, local)) / 8 == \
                    pytest.approx(plain_loss, abs=1e-6)
    # the fused optimiser really updates the tables: the rows of the first batch moved
    first = make_rows(0, 8)
    before, after = expected[0]["model"][TABLES["C1"]], expected[1]["model"][TABLES["C1"]]
    touched = torch.zeros(50, dtype=torch.bool).index_fill_(0, first.c1, True)
    assert (before[touched] != after[touched]).any(dim=1).all()
    assert torch.equal(before[~touched], after[~touched])


def test_a_checkpoint_moves_between_world_sizes_and_to_a_train_step(ranks: Ranks) -> None:
    two = ranks.run(train, 2, [(3, 5), (8, 0)], SMALL, ADAGRAD)[0]
    saved = two.states[-1]
    assert saved is not None and saved["rows_trained"] == 16
    expected, _ = plain_run(SMALL, ADAGRAD, [8, 8])
    assert_states_close(saved, expected[-1])
    momentum = saved["sparse_optimizer"]["state"]["C1.weight"]["C1.weight.momentum_1"]
    assert momentum.abs().sum() > 0

    # the next step on 3 ranks, on 1 rank and in a plain TrainStep loaded from the checkpoint
    served = to_train_step(saved, SCHEMA, SMALL, ADAGRAD)
    assert_states_close(served.state_dict(), saved, rtol=0.0)
    plain_loss = served.step(batch(make_rows(0, 8)))
    three = ranks.run(train, 3, [(3, 0, 5)], SMALL, ADAGRAD, None, saved)[0]
    one = ranks.run(train, 1, [(8,)], SMALL, ADAGRAD, None, saved)[0]
    for trained in (three, one):
        assert_states_close(trained.states[0], saved, rtol=0.0)
        assert_states_close(trained.states[1], served.state_dict())
    assert one.losses[0] == pytest.approx(plain_loss, abs=1e-6)
    assert not torch.equal(served.state_dict()["model"][TABLES["C1"]],
                           saved["model"][TABLES["C1"]])


def test_column_wise_tables_keep_the_unsharded_optimiser_state(ranks: Ranks) -> None:
    two = ranks.run(train, 2, [(5, 3)], WIDE, ADAGRAD, ["column_wise"])[0]
    assert two.plan == {name: "column_wise [0, 1]" for name in SCHEMA.sparse_names}
    # after one step each column shard's row-wise Adagrad state is the mean of its columns'
    # squared gradients; their weighted mean is the unsharded state, and the dense part (whose
    # gradients the sparse optimiser did not yet affect) is the plain step's
    expected, _ = plain_run(WIDE, ADAGRAD, [8])
    saved = two.states[1]
    assert saved is not None
    assert_states_close(saved["sparse_optimizer"], expected[1]["sparse_optimizer"])
    dense = [key for key in expected[1]["model"] if key not in TABLES.values()]
    assert_states_close({key: saved["model"][key] for key in dense},
                        {key: expected[1]["model"][key] for key in dense})
    # 3 ranks take the two column shards of each table, and give back the same state
    three = ranks.run(train, 3, [], WIDE, ADAGRAD, ["column_wise"], saved)[0]
    assert_states_close(three.states[0], saved, rtol=1e-6)


def test_tables_that_do_not_fit_are_refused_on_every_rank(ranks: Ranks) -> None:
    messages = ranks.run(refusal, 2, 10_000)
    assert messages[2] is None and messages[0] == messages[1]
    message = messages[0]
    assert message is not None
    for part in ("3 tables", "3,200 bytes", "2 rank(s)", "[10000] bytes"):
        assert part in message, message


@pytest.mark.parametrize("optim", [ADAGRAD, OptimConfig(sparse_optimizer="adagrad")],
                         ids=["rowwise_adagrad", "adagrad"])
def test_shards_each_rank_wrote_load_on_any_number_of_ranks(ranks: Ranks, tmp_path: Path,
                                                           optim: OptimConfig) -> None:
    """Two ranks holding column shards write them; the files are the gathered state, and
    three ranks table-wise, one rank and a plain TrainStep load exactly that state."""
    folder = str(tmp_path / "model")
    two = ranks.run(written, 2, folder, [(5, 3), (2, 6)], WIDE, optim, ["column_wise"])
    files, state = two[0]
    assert two[1][0] == files and two[1][1] is None
    assert sorted(files) == ["model-00000-of-00002.bin", "model-00001-of-00002.bin",
                             "model-dense.pt"]
    for name, digest in files.items():
        data = (tmp_path / "model" / name).read_bytes()
        assert digest == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == sorted(files)  # no temps
    assert state is not None and state["rows_trained"] == 16
    assert_states_close(read_full_state(folder, files), state, rtol=1e-6)

    three, _, _ = ranks.run(loaded, 3, folder, list(files), WIDE, optim, ["table_wise"])
    one = ranks.run(loaded, 1, folder, list(files), WIDE, optim)[0]
    assert set(three[1].values()) == {"table_wise [0]", "table_wise [1]", "table_wise [2]"}
    for found in (three, one):
        assert_states_close(found[0], state, rtol=1e-6)
    served = read_train_step(folder, files, SCHEMA, WIDE, optim)
    assert_states_close(served.state_dict(), state, rtol=1e-6)


def test_a_warm_start_gives_every_rank_its_part_of_the_source(ranks: Ranks,
                                                               tmp_path: Path) -> None:
    """A sync job starts from a model in one piece (a partial start: a table of other rows
    left at the seed's draw) and from parts three ranks wrote, on two ranks: the gathered
    model is the source's (weights and both optimisers' states) before its first step."""
    folder = str(tmp_path / "parts")
    files, source = ranks.run(written, 3, folder, [(3, 2, 3), (8, 0, 0)], SMALL, ADAGRAD)[0]
    assert source is not None
    init = plan("parts", "parts", folder, files, source_shapes("parts", folder, files),
                job_shapes(SCHEMA, SMALL, ADAGRAD), partial=False)
    found = ranks.run(warmed, 2, init, SMALL, ADAGRAD)[0]
    assert_states_close(found, source, rtol=0.0)

    piece = tmp_path / "piece"
    piece.mkdir()
    torch.save(source, piece / STATE_FILE)
    wider = Schema.from_dict(SCHEMA.to_dict() | {"sparse": [
        {"name": "C1", "num_embeddings": 70}, *SCHEMA.to_dict()["sparse"][1:]]})
    init = plan("piece", "state", str(piece), {}, source_shapes("state", str(piece), {}),
                job_shapes(wider, SMALL, ADAGRAD), partial=True)
    assert init.left == ("table C1",)
    found = ranks.run(warmed, 2, init, SMALL, ADAGRAD, wider)[0]
    fresh = TrainStep(wider, SMALL, ADAGRAD, device=CPU, seed=1).state_dict()
    assert torch.equal(found["model"][TABLES["C1"]], fresh["model"][TABLES["C1"]])
    assert not found["sparse_optimizer"]["state"]["C1.weight"]["C1.weight.momentum_1"].any()
    for key, value in source["model"].items():
        if key != TABLES["C1"]:
            assert torch.equal(found["model"][key], value), key
    assert_states_close(found["sparse_optimizer"]["state"]["C2.weight"],
                        source["sparse_optimizer"]["state"]["C2.weight"], rtol=0.0)
    assert found["rows_trained"] == 0


def test_shards_missing_a_rank_are_refused_naming_the_files(ranks: Ranks,
                                                            tmp_path: Path) -> None:
    folder = str(tmp_path / "model")
    files = ranks.run(written, 2, folder, [], SMALL, ADAGRAD)[0][0]
    partial = [name for name in files if name != "model-00001-of-00002.bin"]
    with pytest.raises(ValueError, match=r"expected model-dense.pt and one file per rank .* "
                                         r"found \['model-00000-of-00002.bin', "
                                         r"'model-dense.pt'\]"):
        read_full_state(folder, partial)


def test_shards_that_cannot_be_written_fail_on_every_rank_naming_each(ranks: Ranks,
                                                                      tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    messages = ranks.run(write_failure, 2, str(blocked / "model"))
    assert messages[2] is None and messages[0] == messages[1]
    assert messages[0] is not None
    assert messages[0].startswith(f"the model could not be written into {blocked / 'model'}: "
                                  "rank 0: ")
    assert "; rank 1: " in messages[0]


BIG = Schema.from_dict({"label": "label", "dense": ["I1", "I2"],
                        "sparse": [{"name": "C1", "num_embeddings": 200_000},
                                   {"name": "C2", "num_embeddings": 200_000}]})
"""Tables of 13 MB: the planner's own reserve (a few MB) no longer hides them."""


def test_a_rank_whose_memory_cannot_hold_the_whole_model_is_not_gathered_on(
        ranks: Ranks) -> None:
    """Every rank gives the same answer for each rank, naming the sizes."""
    assert ranks.run(gather_refusals, 2, 80 * 2**20, BIG)[:2] == [[None, None]] * 2
    refused = ranks.run(gather_refusals, 2, 12 * 2**20, BIG)
    assert refused[0] == refused[1]
    whole = model_bytes(BIG, SMALL, ADAGRAD).total
    shard = 200_000 * (8 + 1) * 4  # one table and its row-wise Adagrad state
    assert refused[0] is not None and refused[0][1] == (
        f"the whole model ({whole / 2**20:.1f} MiB) gathered on rank 1 would need about "
        f"{(3 * whole + shard) / 2**20:.1f} MiB (3 copies beside its own shards of "
        f"{shard / 2**20:.1f} MiB), more than its 12.0 MiB")

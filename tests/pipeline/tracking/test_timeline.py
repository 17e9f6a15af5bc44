"""The timeline PNG: a valid image for real jobs and empty ones, a height that follows the number
of workers within a bound, and input errors that name the lease and the value."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from pipeline.tracking.timeline import (OUTCOME_STYLE, OUTCOMES, ActionMark, LeaseSpan,
                                        cumulative_rows, render_timeline)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """``(width, height)`` of a PNG, after checking its signature and decoding it."""
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    height, width = imread(str(path)).shape[:2]
    return width, height


def pixels_of(path: Path, colour: str) -> int:
    """How many pixels of the PNG at ``path`` have the colour ``#RRGGBB`` (within rounding)."""
    rgb = np.array([int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    image = imread(str(path))[..., :3]
    return int((np.abs(image - rgb).max(axis=-1) < 0.01).sum())


BAR_PIXELS = 2000
"""More pixels than an outcome's swatch in the key: a colour this frequent is drawn as bars."""


def one_lease_each(workers: int) -> list[LeaseSpan]:
    return [LeaseSpan(f"worker{i}", i, 0.1 * i, 0.1 * i + 5.0, 1000, "finished")
            for i in range(workers)]


def test_small_job_with_every_outcome_and_action(tmp_path: Path) -> None:
    spans = [LeaseSpan(f"worker{i % 3} (tcp://127.0.0.1:{4000 + i % 3})", i, 2.0 * (i // 3),
                       2.0 * (i // 3) + 1.5 + 0.5 * (i % 2), 512 * (i + 1), outcome)
             for i, outcome in enumerate(OUTCOMES * 2)]
    actions = [ActionMark(3.0, "worker1 (tcp://127.0.0.1:4001)", kind, rows, "slow")
               for kind, rows in [("reassign", 256), ("split", 128), ("revoke", 512),
                                  ("adjust_batch", None)]]
    actions += [ActionMark(4.0, "worker9 (tcp://127.0.0.1:4009)", "retire", None, "hung"),
                ActionMark(5.0, "worker0 (tcp://127.0.0.1:4000)", "custom_policy", 7, "why")]

    path = tmp_path / "artifacts" / "plots" / "timeline.png"  # folders created on the way
    assert render_timeline(spans, actions, str(path), title="job tiny") == str(path)

    width, height = png_size(path)
    assert width > 800 and height > 300
    for outcome in OUTCOMES:  # every outcome's bars, in its own colour
        assert pixels_of(path, OUTCOME_STYLE[outcome][0]) > BAR_PIXELS, outcome


def test_height_grows_with_workers_and_is_bounded(tmp_path: Path) -> None:
    heights = {}
    for workers in (3, 20, 200):
        path = tmp_path / f"w{workers}.png"
        render_timeline(one_lease_each(workers), [], str(path))
        heights[workers] = png_size(path)[1]

    assert heights[3] < heights[20] < heights[200] <= 2000


def test_empty_job_still_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "empty.png"
    render_timeline([], [], str(path))
    width, height = png_size(path)
    assert width > 0 and height > 0
    assert all(pixels_of(path, colour) == 0 for colour, _ in OUTCOME_STYLE.values())


def test_actions_without_leases_get_lanes(tmp_path: Path) -> None:
    path, empty = tmp_path / "actions_only.png", tmp_path / "empty.png"
    render_timeline([], [ActionMark(1.0, "worker3", "retire", None, "hung")], str(path))
    render_timeline([], [], str(empty))
    assert png_size(path) == png_size(empty)
    # a lane and its marker where the empty job has only its message, and still no bars
    assert not np.array_equal(imread(str(path)), imread(str(empty)))
    assert all(pixels_of(path, colour) == 0 for colour, _ in OUTCOME_STYLE.values())


@pytest.mark.parametrize("span, named", [
    (LeaseSpan("worker0", 17, 0.0, 1.0, 10, "exploded"), ["17", "worker0", "'exploded'",
                                                          "finished"]),
    (LeaseSpan("worker1", 23, 5.0, 4.5, 10, "finished"), ["23", "worker1", "4.5", "5.0",
                                                          "end >= start"]),
    (LeaseSpan("worker2", 42, 0.0, 1.0, -3, "split"), ["42", "worker2", "-3", "rows >= 0"]),
    (LeaseSpan("worker3", 8, float("nan"), 1.0, 3, "split"), ["8", "worker3", "nan"]),
])
def test_bad_span_is_named(tmp_path: Path, span: LeaseSpan, named: list[str]) -> None:
    path = tmp_path / "bad.png"
    with pytest.raises(ValueError) as error:
        render_timeline(one_lease_each(2) + [span], [], str(path))
    for text in named:
        assert text in str(error.value)
    assert not path.exists()


def test_action_with_no_time_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'retire' on worker 'worker1'.*nan"):
        render_timeline([], [ActionMark(float("nan"), "worker1", "retire", None, "hung")],
                        str(tmp_path / "bad.png"))


def test_cumulative_rows_spreads_each_lease_over_its_span() -> None:
    spans = [LeaseSpan("w0", 0, 0.0, 10.0, 100, "finished"),
             LeaseSpan("w1", 1, 5.0, 5.0, 30, "revoked"),
             LeaseSpan("w1", 2, 5.0, 15.0, 50, "lost")]
    times, rows = cumulative_rows(spans)

    assert times.tolist() == [0.0, 0.0, 5.0, 5.0, 10.0, 10.0, 15.0, 15.0]
    np.testing.assert_allclose(rows, [0.0, 0.0, 50.0, 80.0, 155.0, 155.0, 180.0, 180.0])
    assert np.all(np.diff(rows) >= 0)
    assert [len(a) for a in cumulative_rows([])] == [0, 0]


def test_renders_from_threads_at_once(tmp_path: Path) -> None:
    paths = [tmp_path / f"t{i}.png" for i in range(2)]
    threads = [threading.Thread(target=render_timeline, args=(one_lease_each(2), [], str(p)))
               for p in paths]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({png_size(p) for p in paths}) == 1

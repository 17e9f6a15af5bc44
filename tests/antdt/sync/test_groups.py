"""SyncScheduler, on an injected clock: groups of similar progress, waits bounded by max_wait and
by members that are away or late, joiners, the final round and its leader."""

from __future__ import annotations

import random

import pytest

from antdt.sync import MemberState, SyncError, SyncGroup, SyncScheduler


def joined(names: list[str], group_size: int, max_wait_s: float,
           max_progress_gap: int | None = None, away_spans: float = 0) -> SyncScheduler:
    scheduler = SyncScheduler(group_size, max_wait_s, max_progress_gap, away_spans)
    for name in names:
        scheduler.join(name)
    return scheduler


def test_groups_have_similar_progress_and_partners_learn_on_next_call() -> None:
    s = joined(["a", "b", "c", "d"], group_size=2, max_wait_s=10.0, max_progress_gap=100)
    assert s.ready("a", 0, now=0.0).kind == "wait"
    assert s.ready("c", 1000, now=0.0).kind == "wait"
    answer = s.ready("d", 1010, now=0.0)
    assert answer.group is not None and answer.group.members == ("c", "d")
    assert s.state("c") is MemberState.ASSIGNED and s.state("d") is MemberState.IDLE
    assert s.ready("c", 1005, now=0.1) == answer  # handed over, whatever progress says
    answer = s.ready("b", 10, now=0.2)
    assert answer.group is not None and answer.group.members == ("a", "b")
    assert answer.group.round > 0 and not answer.group.final
    assert s.ready("a", 0, now=1.0) == answer  # a picks up its group
    assert s.ready("a", 0, now=1.0).kind == "wait"
    assert s.ready("c", 1000, now=1.0).kind == "wait"  # too far from a ...
    answer = s.ready("a", 0, now=11.0)  # ... until a waited max_wait_s
    assert answer.group is not None and answer.group.members == ("a", "c")


def test_max_wait_gives_a_partial_group_or_alone() -> None:
    s = joined(["a", "b", "c", "d"], group_size=4, max_wait_s=1.0)
    assert s.ready("a", 0, now=0.0).kind == "wait"
    assert s.ready("b", 5, now=0.5).kind == "wait"
    assert s.wait_left("a", now=0.5) == pytest.approx(0.5)
    answer = s.ready("a", 0, now=1.0)  # waited long enough: take whoever is ready
    assert answer.group is not None and answer.group.members == ("a", "b")
    assert s.ready("c", 0, now=2.0).kind == "wait"
    assert s.ready("c", 0, now=3.0).kind == "alone"
    assert s.state("c") is MemberState.IDLE


def test_a_worker_waiting_too_long_joins_the_next_group() -> None:
    s = joined(["lead", "a", "b"], group_size=2, max_wait_s=1.0, max_progress_gap=100)
    assert s.ready("lead", 500, now=0.0).kind == "wait"
    assert s.ready("a", 0, now=0.6).kind == "wait"
    answer = s.ready("b", 0, now=1.5)  # a is nearer, but lead has waited max_wait_s
    assert answer.group is not None and answer.group.members == ("b", "lead")
    assert s.ready("a", 0, now=1.55).kind == "wait"


def test_groups_do_not_wait_for_a_member_that_is_away() -> None:
    """Members train 1 s between asks; after 3 spans without asking, a member is away: the
    others' groups form without it, and it is grouped again when it asks."""
    s = joined(["a", "b", "c"], group_size=4, max_wait_s=100.0, away_spans=3.0)
    now = 0.0
    for _ in range(3):  # everyone trains 1 s a span and syncs with everyone
        s.ready("a", 0, now)
        s.ready("b", 0, now)
        assert s.ready("c", 0, now).group is not None
        s.ready("a", 0, now)
        s.ready("b", 0, now)  # both pick up their group: training again from `now`
        now += 1.0
    # c hangs: it stopped asking at 2.0
    assert s.ready("a", 0, now).kind == "wait"  # c trained 1 s: not away yet
    assert s.ready("b", 0, now).kind == "wait"
    assert s.wait_left("a", now) == pytest.approx(2.0)  # c goes away at 2.0 + 3 spans
    answer = s.ready("b", 0, now=5.0)  # asked again when its wait ran out
    assert answer.group is not None and answer.group.members == ("a", "b")
    s.ready("a", 0, now=5.0)
    assert s.ready("c", 0, now=7.5).kind == "wait"  # back, and waits for a, b (2.5 s of 1 s
    s.ready("a", 0, now=7.5)                       # spans: expected, not away)
    answer = s.ready("b", 0, now=7.5)
    assert answer.group is not None and answer.group.members == ("a", "b", "c")


def test_a_member_twice_as_slow_is_late_for_the_fast_one_and_waits_for_it() -> None:
    """fast asks every second, slow every two (each at its progress, 100 rows a second): fast
    goes on alone when slow is mid-span and groups with it when slow is due; slow waits for
    fast, which is due within its span."""
    s = joined(["fast", "slow"], group_size=4, max_wait_s=100.0, away_spans=3.0)
    s.ready("fast", 0, now=0.0)
    assert s.ready("slow", 0, now=0.0).kind == "group"
    s.ready("fast", 0, now=0.0)
    assert s.ready("fast", 100, now=1.0).kind == "wait"  # no pace measured yet: waited for
    assert s.ready("slow", 100, now=2.0).kind == "group"
    s.ready("fast", 100, now=2.0)  # both trained from 2.0: fast at 1 s a span, slow at 2 s
    assert s.ready("fast", 300, now=3.0).kind == "alone"  # slow is due at 4.0: late
    assert s.ready("fast", 400, now=4.0).kind == "wait"  # slow is due now
    answer = s.ready("slow", 200, now=4.0)
    assert answer.group is not None and answer.group.members == ("fast", "slow")
    s.ready("fast", 400, now=4.0)
    assert s.ready("fast", 500, now=5.0).kind == "alone"
    assert s.ready("slow", 300, now=6.0).kind == "wait"  # fast is due within half slow's span
    answer = s.ready("fast", 600, now=6.1)
    assert answer.group is not None and answer.group.members == ("fast", "slow")


def test_an_idle_member_waits_for_a_late_one() -> None:
    """A member that trained nothing since its previous ask (no lease left, its rows waiting
    for sync) waits for the others even when they are late: it loses no training, and its rows
    are synced only once they applied them."""
    s = joined(["fast", "slow"], group_size=4, max_wait_s=100.0, away_spans=3.0)
    s.ready("fast", 0, now=0.0)
    assert s.ready("slow", 0, now=0.0).kind == "group"
    s.ready("fast", 0, now=0.0)
    s.ready("fast", 100, now=1.0)
    assert s.ready("slow", 100, now=2.0).kind == "group"
    s.ready("fast", 100, now=2.0)  # both trained from 2.0: fast at 1 s a span, slow at 2 s
    assert s.ready("fast", 300, now=3.0).kind == "alone"  # training: slow is late
    assert s.ready("fast", 300, now=3.1).kind == "wait"  # idle: it waits for slow after all
    assert s.wait_left("fast", now=3.1) > 0
    answer = s.ready("slow", 200, now=4.0)
    assert answer.group is not None and answer.group.members == ("fast", "slow")


def test_a_caller_is_idle_by_the_batches_it_trained_when_it_says_them() -> None:
    """The hybrid mode's replica counts no rows: its progress stays 0. Judged by progress, the
    fast member looked idle at every ask and waited for the 2x slow one every time; judged by
    the batches it says it trained, it is idle only when it trained none since its previous
    ask."""
    for says_batches in (False, True):
        s = joined(["fast", "slow"], group_size=4, max_wait_s=100.0, away_spans=3.0)

        def ask(worker: str, batches: int, now: float) -> str:
            return s.ready(worker, 0, now, batches=batches if says_batches else None).kind

        ask("fast", 0, now=0.0)
        assert ask("slow", 0, now=0.0) == "group"
        ask("fast", 0, now=0.0)
        ask("fast", 1, now=1.0)
        assert ask("slow", 1, now=2.0) == "group"
        ask("fast", 1, now=2.0)  # both trained from 2.0: fast at 1 s a span, slow at 2 s
        # slow is due at 4.0: late for fast, which trained a batch; progress alone says idle
        assert ask("fast", 2, now=3.0) == ("alone" if says_batches else "wait")
        if says_batches:
            assert ask("fast", 2, now=3.1) == "wait"  # no batch since: idle, waits for slow
        answer = s.ready("slow", 0, now=4.0, batches=2 if says_batches else None)
        assert answer.group is not None and answer.group.members == ("fast", "slow")


def test_nobody_is_away_before_a_span_is_measured_or_with_away_spans_0() -> None:
    for away_spans in (3.0, 0.0):
        s = joined(["a", "b"], group_size=2, max_wait_s=100.0, away_spans=away_spans)
        assert s.ready("a", 0, now=50.0).kind == "wait"
        assert s.wait_left("a", now=50.0) == pytest.approx(100.0)


def test_group_size_is_capped_by_active_members() -> None:
    s = joined(["a", "b", "c"], group_size=8, max_wait_s=100.0)
    s.ready("a", 0, now=0.0)
    s.ready("b", 0, now=0.0)
    answer = s.ready("c", 0, now=0.0)
    assert answer.group is not None and answer.group.members == ("a", "b", "c")
    solo = joined(["a"], group_size=2, max_wait_s=100.0)
    assert solo.ready("a", 0, now=0.0).kind == "alone"


def test_final_round_forms_when_every_live_member_finished() -> None:
    s = joined(["a", "b", "c"], group_size=2, max_wait_s=100.0)
    s.ready("a", 0, now=0.0)
    pending = s.ready("b", 0, now=0.0)  # a is ASSIGNED to this group
    assert s.ready("b", 0, now=0.0, final=True).kind == "wait"
    assert s.ready("a", 0, now=0.0, final=True) == pending  # the pending group comes first
    assert s.ready("a", 0, now=0.0, final=True).kind == "wait"
    s.ready("c", 0, now=0.0)
    with pytest.raises(SyncError, match="received the final"):
        s.final_step("c")
    with pytest.raises(SyncError, match="expected final=True"):
        s.ready("a", 0, now=0.0)
    final = s.leave("c")  # the last one still training dies
    assert final is not None and final.final and final.members == ("a", "b")
    for name in ("a", "b"):
        answer = s.ready(name, 0, now=1.0, final=True)
        assert answer.group == final and s.state(name) is MemberState.DONE
    assert s.ready("a", 0, now=2.0).group == final  # asked again: same answer
    assert s.final_leader() == "a"  # the smallest address
    assert s.departed() == {"c": 0}
    assert (s.final_step("a"), s.final_step("b")) == ("gather", "wait")
    with pytest.raises(SyncError, match="final round"):
        s.join("late")


def test_join_running_waits_for_every_member_to_acknowledge() -> None:
    s = joined(["a", "b"], group_size=2, max_wait_s=100.0)
    listed = s.members_version
    assert s.acknowledge("a", listed) is False
    s.join_running("j")
    assert s.joined_running("j") and not s.joined_running("a")
    assert s.waiting_for("j") == ["a", "b"] and not s.settled("j")
    assert s.acknowledge("a", listed) is False and s.waiting_for("j") == ["a", "b"]  # stale list
    assert s.acknowledge("a", s.members_version) is False and s.waiting_for("j") == ["b"]
    s.join_running("k")  # j has not acknowledged k's join either
    assert s.waiting_for("k") == ["a", "b", "j"]
    s.join_running("j")  # idempotent
    assert s.waiting_for("k") == ["a", "b", "j"]
    assert s.acknowledge("b", s.members_version) is True  # settles j (and acknowledges k)
    assert s.settled("j") and s.waiting_for("k") == ["a", "j"]
    s.leave("j")
    assert s.acknowledge("a", s.members_version) is True and s.settled("k")
    assert s.state("k") is MemberState.IDLE  # not grouped until it asks
    with pytest.raises(SyncError, match="members_version must be"):
        s.acknowledge("a", s.members_version + 1)
    s.started("k", now=0.0)  # it took its snapshot: the final round waits for it
    for name in s.members():
        s.ready(name, 0, now=0.0, final=True)
    with pytest.raises(SyncError, match="final round"):
        s.join_running("late")


def test_a_joiner_holds_no_group_and_no_final_round_until_it_started() -> None:
    s = joined(["a", "b", "c"], group_size=4, max_wait_s=100.0)
    s.join_running("j")
    for name in ("a", "b", "c"):
        s.acknowledge(name, s.members_version)
    assert s.settled("j")  # taking its snapshot now: the others' rounds do not wait for it
    assert [s.ready(n, 0, now=0.0).kind for n in ("a", "b", "c")] == ["wait", "wait", "group"]
    assert [s.ready(n, 0, now=1.0).kind for n in ("a", "b")] == ["group"] * 2  # handed over
    s.started("j", now=1.0)  # it trains: a full group is all four again
    assert [s.ready(n, 0, now=2.0).kind for n in ("a", "b", "c")] == ["wait"] * 3
    assert s.ready("j", 0, now=2.0).group == SyncGroup(2, ("a", "b", "c", "j"), final=False)

    s = joined(["a", "b"], group_size=4, max_wait_s=100.0)
    s.join_running("j")
    s.join_running("k")
    s.started("k", now=0.0)
    for name in ("a", "b", "k"):
        assert s.ready(name, 0, now=0.0, final=True).kind in ("wait", "group")
    assert s.final is not None and s.final.members == ("a", "b", "k")  # not waiting for j
    assert s.members() == ["a", "b", "k"]
    for call in (lambda: s.started("j", now=0.0), lambda: s.settled("j"),
                 lambda: s.ready("j", 0, now=0.0, final=True)):
        with pytest.raises(SyncError, match=r"final round \d+ formed while it was joining"):
            call()


def test_the_final_leader_gathers_and_the_others_adopt_its_rows() -> None:
    s = joined(["a", "b", "c", "d"], group_size=4, max_wait_s=100.0)
    s.leave("d", synced_rows=96)  # d died with 96 rows counted synced
    assert s.departed() == {"d": 96} and s.final_leader() is None
    for _ in range(2):  # the last one forms the final group, the others pick it up
        for name in ("c", "b", "a"):
            s.ready(name, 0, now=0.0, final=True)
    assert s.final_leader() == "a"
    assert [s.final_step(n) for n in ("a", "b", "c")] == ["gather", "wait", "wait"]
    with pytest.raises(SyncError, match="expected the final leader 'a'"):
        s.gathered("c")
    s.gathered("a")
    assert [s.final_step(n) for n in ("a", "b", "c")] == ["wait", "adopt", "adopt"]
    s.adopted("c", "a")
    assert s.final_step("c") == "wait" and s.adopted_from("c") == "a" and not s.final_done()
    s.adopted("b", "a")
    assert s.final_done() and [s.final_step(n) for n in ("a", "b", "c")] == ["done"] * 3
    s.leave("a")  # the leader dies: b leads and gathers again
    assert s.final_leader() == "b" and not s.final_done()
    assert [s.final_step(n) for n in ("b", "c")] == ["gather", "wait"]
    s.gathered("b")
    assert s.final_step("c") == "adopt"
    s.adopted("c", "b")
    assert s.final_done() and s.final_step("b") == "done"


def test_leave_and_unknown_workers() -> None:
    s = joined(["a", "b"], group_size=2, max_wait_s=100.0)
    version = s.members_version
    assert s.ready("a", 0, now=0.0).kind == "wait"
    assert s.leave("a") is None and s.leave("a") is None
    assert s.members() == ["b"] and s.members_version == version + 1
    assert s.ready("b", 0, now=0.0).kind == "alone"  # the waiting pool no longer holds a
    with pytest.raises(SyncError, match="not a sync member"):
        s.ready("a", 0, now=0.0)
    with pytest.raises(SyncError, match="group_size"):
        SyncScheduler(group_size=1)


def test_the_groups_of_ten_thousand_workers_are_disjoint() -> None:
    """Nobody is in two groups at once, and every group has 2 to 4 members (what an ask costs
    at this scale is `antdt bench sharding`'s figure)."""
    rng = random.Random(0)
    names = [f"w{i}" for i in range(10_000)]
    s = joined(names, group_size=4, max_wait_s=0.5)
    progress = dict.fromkeys(names, 0)
    pending: dict[str, int] = {}  # partner -> round of the group it has not picked up yet
    seen: set[int] = set()
    sizes: list[int] = []
    now = 0.0
    for _ in range(50_000):
        now += 0.001
        name = rng.choice(names)
        progress[name] += rng.randint(0, 100)
        answer = s.ready(name, progress[name], now)
        group = answer.group
        if group is None:
            assert name not in pending
        elif group.round in seen:
            assert pending.pop(name) == group.round
        else:
            seen.add(group.round)
            assert name not in pending
            for member in group.members:
                if member != name:
                    assert member not in pending  # nobody is in two groups at once
                    pending[member] = group.round
            sizes.append(len(group.members))
    assert sizes and min(sizes) >= 2 and max(sizes) == 4

"""New requests' setups take turns with the relay (``proxy.turns.SetupTurns``): within one
loop iteration they share a budget of wall time; the rest queue and go one an iteration, in
arrival order, with whatever the loop does between iterations (polling, relaying) between."""

from __future__ import annotations

import asyncio

import pytest

from conftest import CHAT, chat, proxy_client, sample
from proxy.turns import SetupTurns


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Count:
    def __init__(self) -> None:
        self.value = 0

    def inc(self) -> None:
        self.value += 1


class Rig:
    """Setups that each take ``work_s`` of a fake clock, and a callback that marks every loop
    iteration with "|" (as the poll and relay between iterations would)."""

    def __init__(self, budget_s: float) -> None:
        self.clock, self.count, self.order = Clock(), Count(), []
        self.turns = SetupTurns(budget_s, deferrals=self.count, clock=self.clock)
        self._ticking = False

    def start_ticks(self) -> None:
        loop = asyncio.get_running_loop()

        def tick() -> None:
            if self._ticking:
                self.order.append("|")
                loop.call_soon(tick)

        self._ticking = True
        loop.call_soon(tick)

    async def setup(self, name: str, work_s: float) -> None:
        await self.turns.wait()
        self.order.append(name)
        self.clock.now += work_s

    async def run(self, names: str, work_s: float) -> list[str]:
        """The groups of setups that ran in one iteration each, in order."""
        tasks = [asyncio.create_task(self.setup(n, work_s)) for n in names]
        self.start_ticks()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)  # (a turn never handed on would hang them)
        self._ticking = False
        return [g for g in "".join(self.order).split("|") if g]


async def test_setups_past_the_budget_queue_and_go_one_an_iteration_in_order():
    rig = Rig(budget_s=0.0002)
    assert await rig.run("abcd", work_s=0.0003) == ["a", "b", "c", "d"]
    assert rig.count.value == 3  # b, c and d queued, once each
    assert "".join(rig.order).startswith("a||b|c|d")  # the queue starts the iteration after next


async def test_setups_within_the_budget_share_an_iteration():
    rig = Rig(budget_s=0.0002)
    assert await rig.run("abcd", work_s=0.00004) == ["abcd"]
    assert rig.count.value == 0


async def test_each_iteration_starts_a_fresh_budget():
    rig = Rig(budget_s=0.0002)
    # a-d start within 200 us of a (0, 60, 120, 180); the rest queue
    assert await rig.run("abcdefg", work_s=0.00006) == ["abcd", "e", "f", "g"]
    assert rig.count.value == 3


async def test_a_burst_costs_a_loop_iteration_a_setup_not_one_per_retry():
    """Linear, not quadratic: 500 setups at once queue once each and go in ~500 iterations
    (a deferred setup retrying every iteration would make ~125,000 retries)."""
    rig = Rig(budget_s=0.0002)
    groups = await rig.run([f"{i:03d}" for i in range(500)], work_s=0.0003)
    assert len(groups) == 500 and rig.count.value == 499
    assert rig.order.count("|") <= 505


async def test_new_setups_queue_behind_the_queued_ones():
    rig = Rig(budget_s=0.0002)
    first = [asyncio.create_task(rig.setup(n, 0.0003)) for n in "abc"]
    rig.start_ticks()
    await asyncio.sleep(0)  # a ran; b and c queued
    late = asyncio.create_task(rig.setup("d", 0.0))  # cheap, and the budget is fresh: still behind b, c
    await asyncio.wait_for(asyncio.gather(*first, late), 5)
    assert [x for x in rig.order if x != "|"] == ["a", "b", "c", "d"]


@pytest.mark.parametrize("when", ["queued", "handed"])
async def test_a_cancelled_setup_gives_up_its_place(when):
    """A client that leaves while its setup waits: skipped while queued; if its turn had
    come already, the turn passes to the next. Nobody hangs."""
    rig = Rig(budget_s=0.0002)
    tasks = {n: asyncio.create_task(rig.setup(n, 0.0003)) for n in "abcd"}
    rig.start_ticks()
    await asyncio.sleep(0)  # a ran; b, c, d queued
    if when == "handed":
        await asyncio.sleep(0)  # the next iteration: b's turn has been handed, b not yet run
        assert rig.turns._handed
    tasks["b"].cancel()
    await asyncio.wait_for(asyncio.gather(tasks["a"], tasks["c"], tasks["d"]), 5)
    with pytest.raises(asyncio.CancelledError):
        await tasks["b"]
    assert [x for x in rig.order if x != "|"] == ["a", "c", "d"]


async def test_the_gate_counts_its_deferrals_and_answers_every_request(fake):
    """Through the app: with no budget, every setup but an iteration's first queues; all of
    them are answered, and prefill_gate_setup_deferrals_total counts them."""
    async with proxy_client(fake) as (c, state):
        state.turns.budget_s = 0.0
        answers = await asyncio.gather(*(c.post(CHAT, json=chat()) for _ in range(8)))
    assert [r.status_code for r in answers] == [200] * 8
    assert sample(state.metrics.registry, "prefill_gate_setup_deferrals_total") > 0

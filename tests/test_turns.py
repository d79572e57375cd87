"""New requests' setups take turns with the relay (``proxy.turns.SetupTurns``): within one
loop iteration they share a budget of wall time, the rest go in later iterations, in order,
with whatever the loop does between iterations (polling, relaying) in between."""

from __future__ import annotations

import asyncio

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


async def _run_setups(names: list[str], work_s: float, budget_s: float) -> tuple[list[str], int]:
    """Setups that each take ``work_s`` (of a fake clock), all ready in one iteration, and
    a callback that marks every loop iteration (as the poll and relay between them would):
    the order things ran in, and the deferrals counted."""
    clock, count, order = Clock(), Count(), []
    turns = SetupTurns(budget_s, deferrals=count, clock=clock)
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def tick() -> None:  # once an iteration, until the setups are done
        if not done.is_set():
            order.append("|")
            loop.call_soon(tick)

    async def setup(name: str) -> None:
        await turns.wait()
        order.append(name)
        clock.now += work_s

    tasks = [asyncio.create_task(setup(n)) for n in names]
    loop.call_soon(tick)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)  # (a window never closed would hang them)
    done.set()
    return [x for x in "".join(order).rstrip("|")], count.value


async def test_setups_past_the_budget_go_in_later_iterations_in_order():
    order, deferrals = await _run_setups(list("abcd"), work_s=0.0003, budget_s=0.0002)
    # each setup spends the budget alone: one an iteration, in arrival order, iterations between
    assert "".join(order).replace("|", " ").split() == ["a", "b", "c", "d"]
    assert deferrals == 1 + 2 + 3  # b waits an iteration, c two, d three
    assert order.index("b") > order.index("|")


async def test_setups_within_the_budget_share_an_iteration():
    order, deferrals = await _run_setups(list("abcd"), work_s=0.00004, budget_s=0.0002)
    assert "".join(order).split("|")[0] == "abcd"
    assert deferrals == 0


async def test_a_setup_starts_a_fresh_budget_every_iteration():
    # three fit the budget (0, 60, 120 us < 200), the fourth starts the next iteration's
    order, deferrals = await _run_setups(list("abcdefg"), work_s=0.00006, budget_s=0.0002)
    groups = [g for g in "".join(order).split("|") if g]
    assert groups == ["abcd", "efg"]
    assert deferrals == 3


async def test_the_gate_counts_its_deferrals_and_answers_every_request(fake):
    """Through the app: with no budget, every setup but an iteration's first waits; all of
    them are answered, and prefill_gate_setup_deferrals_total counts the waits."""
    async with proxy_client(fake) as (c, state):
        state.turns.budget_s = 0.0
        answers = await asyncio.gather(*(c.post(CHAT, json=chat()) for _ in range(8)))
    assert [r.status_code for r in answers] == [200] * 8
    assert sample(state.metrics.registry, "prefill_gate_setup_deferrals_total") > 0

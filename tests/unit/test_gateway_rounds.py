"""The gateway's group commit (gateway/rounds.py): pure asyncio, the store replaced by a
function that records the rounds it was given (the store's own exchange is exercised
by the gateway's acceptance tests and the store contract)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest

from celery_pulse.gateway.rounds import Rounds


class Recorder:
    """``apply``: answers each operation with its own name upper-cased, holding the round
    until ``release`` is set, so operations can pile up behind it."""

    def __init__(self) -> None:
        self.rounds: list[list[str]] = []
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()

    def __call__(self, items: Sequence[str]) -> list[str | BaseException]:
        self.rounds.append(list(items))
        self.entered.set()
        assert self.release.wait(5)
        return [ValueError(i) if i.startswith("bad") else i.upper() for i in items]


def key(item: str) -> str:
    return item.split(":")[0]


def test_the_first_operation_goes_at_once_and_those_arriving_meanwhile_share_the_next() -> None:
    async def scenario() -> tuple[list[list[str]], list[str]]:
        apply = Recorder()
        apply.release.clear()
        rounds: Rounds[str, str] = Rounds(apply, key)
        first = rounds.submit("a:1")
        await asyncio.get_running_loop().run_in_executor(None, apply.entered.wait, 5)
        later = [rounds.submit(f"{name}:1") for name in ("b", "c", "d")]
        apply.release.set()
        answers = await asyncio.gather(first, *later)
        return apply.rounds, answers

    seen, answers = asyncio.run(scenario())
    assert seen == [["a:1"], ["b:1", "c:1", "d:1"]]
    assert answers == ["A:1", "B:1", "C:1", "D:1"]


def test_two_rounds_go_side_by_side_a_key_never_in_both_and_a_third_waits() -> None:
    """A worker's start sent just after its finish goes beside the finish's round, not
    a whole round later; an operation of a task already in a round waits for it, and
    no more than two rounds are in the store at once."""
    async def scenario() -> list[list[str]]:
        apply = Recorder()
        apply.release.clear()
        rounds: Rounds[str, str] = Rounds(apply, key)
        loop = asyncio.get_running_loop()
        first = rounds.submit("t1:finish")
        await loop.run_in_executor(None, apply.entered.wait, 5)
        apply.entered.clear()
        second = [rounds.submit("t2:start"), rounds.submit("t1:start")]
        await loop.run_in_executor(None, apply.entered.wait, 5)  # beside the first
        third = rounds.submit("t3:start")
        await asyncio.sleep(0.05)
        assert apply.rounds == [["t1:finish"], ["t2:start"]]  # t1 busy; two in the store
        apply.release.set()
        assert await asyncio.gather(first, *second, third) == [
            "T1:FINISH", "T2:START", "T1:START", "T3:START"]
        return apply.rounds

    seen = asyncio.run(scenario())
    assert seen[:2] == [["t1:finish"], ["t2:start"]]
    assert sorted(item for later in seen[2:] for item in later) == ["t1:start", "t3:start"]


def test_a_round_holds_one_operation_per_key_the_next_in_the_following_round() -> None:
    async def scenario() -> list[list[str]]:
        apply = Recorder()
        rounds: Rounds[str, str] = Rounds(apply, key)
        futures = [rounds.submit(i) for i in ("t1:start", "t2:start", "t1:finish")]
        assert await asyncio.gather(*futures) == ["T1:START", "T2:START", "T1:FINISH"]
        return apply.rounds

    assert asyncio.run(scenario()) == [["t1:start", "t2:start"], ["t1:finish"]]


def test_a_round_is_at_most_its_limit() -> None:
    async def scenario() -> list[list[str]]:
        apply = Recorder()
        rounds: Rounds[str, str] = Rounds(apply, key, limit=2)
        await asyncio.gather(*(rounds.submit(f"t{i}") for i in range(5)))
        return apply.rounds

    assert [len(r) for r in asyncio.run(scenario())] == [2, 2, 1]


def test_each_operation_gets_its_own_error_and_a_failed_round_fails_each_of_its_own() -> None:
    async def scenario() -> tuple[list[object], list[object]]:
        apply = Recorder()
        rounds: Rounds[str, str] = Rounds(apply, key)
        one = await asyncio.gather(rounds.submit("ok"), rounds.submit("bad"),
                                   return_exceptions=True)

        def broken(items: Sequence[str]) -> list[str | BaseException]:
            raise ConnectionError("store down")
        failing: Rounds[str, str] = Rounds(broken, key)
        two = await asyncio.gather(failing.submit("x"), failing.submit("y"),
                                   return_exceptions=True)
        # The next round is tried all the same (the holder is not stuck).
        failing.apply = apply
        assert await failing.submit("z") == "Z"
        return one, two

    one, two = asyncio.run(scenario())
    assert one[0] == "OK" and isinstance(one[1], ValueError)
    assert all(isinstance(e, ConnectionError) for e in two)


def test_an_answer_nobody_waits_for_any_more_is_applied_and_not_an_error() -> None:
    async def scenario() -> tuple[list[list[str]], str]:
        apply = Recorder()
        apply.release.clear()
        rounds: Rounds[str, str] = Rounds(apply, key)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(rounds.submit("late"), 0.05)
        apply.release.set()
        return apply.rounds, await rounds.submit("next")

    seen, answer = asyncio.run(scenario())
    assert seen == [["late"], ["next"]] and answer == "NEXT"

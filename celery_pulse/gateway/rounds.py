"""The gateway's group commit: one holder's starts and finishes applied in rounds.

A remote worker's starts and finishes arrive as frames, each an operation of its own.
Applied one statement and one commit each, in a thread each, each operation waited for
a thread, a pooled connection and a commit, and cost the gateway a transaction of its
own (docs/benchmarks.md §10 measures the gateway's CPU per task before and after). Here the operations of
one holder go to the store together, in one call (the store's ``exchange``: one round
trip where it pipelines, as a direct worker's commit thread sends its own):

* At most ``in_flight`` rounds of a holder are in the store at a time (two: a worker's
  start sent just after its finish goes beside it, not a whole round later; one
  ``exchange`` of a worker would otherwise cost two rounds end to end). The first
  operation to reach a holder with room goes at once (nothing lingers, so an idle
  gateway adds no latency); whatever arrives while the rounds are in the store goes in
  the next one.
* A key (a task id) is in one round at a time: a second operation of the same task
  waits until the round holding the first is back, so each attempt's operations apply
  in order and each answer is its own.
* Each operation gets its own answer; a round that fails fails each of its operations
  with that error, and the next round is tried all the same.

Pure asyncio; knows neither the protocol nor the store (the caller's ``apply`` does).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

I = TypeVar("I")  # noqa: E741 (an operation, as the caller defines it)
O = TypeVar("O")  # noqa: E741 (its answer)

#: The most operations of one round (a statement's parameters grow with it).
ROUND_LIMIT = 256
#: The most rounds of one holder in the store at once.
IN_FLIGHT = 2


class Rounds(Generic[I, O]):
    """One holder's operations, applied by ``apply`` (blocking: run in ``executor``) in
    rounds; ``apply`` returns one answer, or the exception that is its answer, per
    operation, in order."""

    def __init__(self, apply: Callable[[Sequence[I]], Sequence[O | BaseException]],
                 key: Callable[[I], str],
                 executor: concurrent.futures.Executor | None = None,
                 limit: int = ROUND_LIMIT, in_flight: int = IN_FLIGHT) -> None:
        self.apply, self.key, self.executor, self.limit = apply, key, executor, limit
        self.in_flight = in_flight
        self._pending: list[tuple[I, asyncio.Future[O]]] = []
        #: The rounds in the store, and the keys they hold.
        self._rounds: set[asyncio.Future[None]] = set()
        self._busy: set[str] = set()
        #: A look for the next round is due at the loop's next turn (what is submitted
        #: in the same turn, a worker's frames read together, shares a round).
        self._kicked = False

    def submit(self, item: I) -> asyncio.Future[O]:
        """The operation's answer, once its round is back. Awaiting it may be abandoned
        (a deadline): the round still applies it."""
        future: asyncio.Future[O] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieved)
        self._pending.append((item, future))
        if not self._kicked:
            self._kicked = True
            asyncio.get_running_loop().call_soon(self._kick)
        return future

    def _kick(self) -> None:
        self._kicked = False
        self._next()

    def _next(self) -> None:
        """Send the next round if there is room for one and something to put in it."""
        if len(self._rounds) >= self.in_flight or not self._pending:
            return
        batch = self._next_round()
        if not batch:
            return  # every key waiting is in a round: its return sends the next
        keys = {self.key(item) for item, _ in batch}
        self._busy |= keys
        round_ = asyncio.ensure_future(self._run(batch))
        self._rounds.add(round_)

        def back(done: asyncio.Future[None]) -> None:
            self._rounds.discard(done)
            self._busy -= keys
            if done.cancelled():  # the gateway stops: nothing more is sent
                for _, future in self._pending:
                    future.cancel()
                self._pending = []
                return
            self._next()
            self._next()  # a round's return may free keys for two

        round_.add_done_callback(back)

    async def _run(self, batch: list[tuple[I, asyncio.Future[O]]]) -> None:
        items = [item for item, _ in batch]
        try:
            answers = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.apply, items)
        except asyncio.CancelledError:
            for _, future in batch:
                future.cancel()
            raise
        except Exception as exc:  # the round's failure is each operation's
            answers = [exc] * len(batch)
        for (_, future), answer in zip(batch, answers, strict=True):
            if future.done():
                continue
            if isinstance(answer, BaseException):
                future.set_exception(answer)
            else:
                future.set_result(answer)

    def _next_round(self) -> list[tuple[I, asyncio.Future[O]]]:
        batch: list[tuple[I, asyncio.Future[O]]] = []
        later: list[tuple[I, asyncio.Future[O]]] = []
        keys: set[str] = set(self._busy)
        for item, future in self._pending:
            key = self.key(item)
            if key in keys or len(batch) >= self.limit:
                later.append((item, future))
            else:
                keys.add(key)
                batch.append((item, future))
        self._pending = later
        return batch


def _retrieved(future: asyncio.Future[Any]) -> None:
    """An answer nobody awaits any more (its deadline passed) is not an error to log."""
    if not future.cancelled():
        future.exception()

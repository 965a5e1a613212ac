"""The gateway's group commit: one holder's starts and finishes applied in rounds.

A remote worker's starts and finishes arrive as frames, each an operation of its own.
Applied one statement and one commit each, in a thread each, each operation waited for
a thread, a pooled connection and a commit, and cost the gateway a transaction of its
own (docs/benchmarks.md §10 measures the gateway's CPU per task before and after). Here the operations of
one holder go to the store together, in one call (the store's ``exchange``: one round
trip where it pipelines, as a direct worker's commit thread sends its own):

* At most one round of a holder is in the store at a time. The first operation to reach
  an idle holder goes at once (nothing lingers, so an idle gateway adds no latency);
  whatever arrives while a round is in the store goes in the next one.
* A round holds at most one operation per key (a task id): a second attempt of the same
  task waits for the next round, so each attempt's answer is its own.
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


class Rounds(Generic[I, O]):
    """One holder's operations, applied by ``apply`` (blocking: run in ``executor``) in
    rounds; ``apply`` returns one answer, or the exception that is its answer, per
    operation, in order."""

    def __init__(self, apply: Callable[[Sequence[I]], Sequence[O | BaseException]],
                 key: Callable[[I], str],
                 executor: concurrent.futures.Executor | None = None,
                 limit: int = ROUND_LIMIT) -> None:
        self.apply, self.key, self.executor, self.limit = apply, key, executor, limit
        self._pending: list[tuple[I, asyncio.Future[O]]] = []
        self._runner: asyncio.Future[None] | None = None

    def submit(self, item: I) -> asyncio.Future[O]:
        """The operation's answer, once its round is back. Awaiting it may be abandoned
        (a deadline): the round still applies it."""
        future: asyncio.Future[O] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieved)
        self._pending.append((item, future))
        if self._runner is None:
            self._runner = asyncio.ensure_future(self._run())
        return future

    async def _run(self) -> None:
        batch: list[tuple[I, asyncio.Future[O]]] = []
        try:
            while self._pending:
                batch = self._next_round()
                items = [item for item, _ in batch]
                try:
                    answers = await asyncio.get_running_loop().run_in_executor(
                        self.executor, self.apply, items)
                except Exception as exc:  # the round's failure is each operation's
                    answers = [exc] * len(batch)
                for (_, future), answer in zip(batch, answers, strict=True):
                    if future.done():
                        continue
                    if isinstance(answer, BaseException):
                        future.set_exception(answer)
                    else:
                        future.set_result(answer)
        finally:
            self._runner = None
            # Cancelled (the gateway stops): nothing more is sent, nobody waits on.
            for _, future in [*batch, *self._pending]:
                future.cancel()
            self._pending = []

    def _next_round(self) -> list[tuple[I, asyncio.Future[O]]]:
        batch: list[tuple[I, asyncio.Future[O]]] = []
        later: list[tuple[I, asyncio.Future[O]]] = []
        keys: set[str] = set()
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

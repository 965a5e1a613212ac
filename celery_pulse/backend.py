"""``result_backend = "pulse://"``: Celery's results in the pulse store.

A key-value backend (Celery's ``KeyValueStoreBackend``) over the store's
``pulse_results`` table (:mod:`celery_pulse.store.sql.results`). Registered under the
``celery.result_backends`` entry point, so ``celery -A proj ...``, Flower and a client
that runs no worker resolve it from the URL alone:

* ``pulse://``: the store named by ``pulse_store_url`` (the embedded SQLite default when
  unset);
* ``pulse+<store url>``, e.g. ``pulse+postgresql+psycopg://host/db``: that store.

It behaves as Celery's Redis backend does where the two can: results expire after
``result_expires``, ``incr`` is atomic (so chords count their parts in the store, with no
``chord_unlock`` polling), and a success is final: a duplicate or stale attempt can't
overwrite it.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from datetime import datetime
from typing import Any

from celery import states
from celery.backends.base import KeyValueStoreBackend
from celery.exceptions import ImproperlyConfigured
from celery.exceptions import TimeoutError as CeleryTimeoutError
from kombu.exceptions import EncodeError

from celery_pulse.deferral import DEFERRED_STATES as DEFERRED_STATES
from celery_pulse.deferral import StoreResults
from celery_pulse.deferral import carried_by_completions as carried_by_completions
from celery_pulse.deferral import deferral as _deferral
from celery_pulse.deferral import deferred_result as deferred_result
from celery_pulse.deferral import same_store as same_store
from celery_pulse.errors import InvalidConfig, StoreUnavailable
from celery_pulse.settings import Settings
from celery_pulse.store.base import ResultRecord
from celery_pulse.store_urls import STORE_SCHEMES, canonical_store_url, mask_url

# The Celery-free spelling of the deferred states must stay Celery's own.
assert frozenset({*states.READY_STATES, states.RETRY}) == DEFERRED_STATES


#: A message header naming the publication (see celery_pulse.install.stamp_publication):
#: a chord's callback published twice (by the worker that counted its last part, then by
#: a recovery after it died) is one publication, run once.
FIXED_PUBLICATION_HEADER = "pulse_pub_fixed"


class _Precounted(threading.local):
    value: int | None = None


_precounted = _Precounted()


def _plain_json_encoder(serializer: str, compression: Any) -> Any:
    """kombu's JSON encoder if ``serializer`` is kombu's own JSON, uncompressed, else False."""
    from kombu.serialization import registry
    from kombu.utils import json as kombu_json

    encoders = getattr(registry, "_encoders", {})
    entry = encoders.get(serializer) if serializer == "json" else None
    if compression or entry is None or entry[2] is not kombu_json.dumps:
        return False
    return kombu_json.JSONEncoder()


def record_fields(record: ResultRecord) -> tuple[Any, ...]:
    """``record`` as a plain tuple, for the pipe to the parent (``ResultRecord(*fields)``
    again there): a slotted dataclass pickles through ``__getstate__``, several times the
    cost, on every task."""
    return (record.key, record.value, record.state, record.expires, record.final,
            record.counter, record.counter_note)


def store_url_for(url: str | None, conf: Any) -> str:
    """The store URL a backend URL names (``pulse://`` -> ``pulse_store_url``)."""
    if url is None or url in ("pulse://", "pulse:///", "pulse"):
        try:
            return Settings.from_conf(conf).store_url
        except InvalidConfig as exc:
            raise ImproperlyConfigured(f"result_backend 'pulse://': {exc}") from exc
    scheme = url.partition("://")[0]
    if scheme not in STORE_SCHEMES:
        raise ImproperlyConfigured(
            f"result_backend: {mask_url(url)!r} names no pulse store; use 'pulse://' (the "
            f"store of pulse_store_url) or 'pulse+<store url>' with one of "
            f"{', '.join(STORE_SCHEMES)}")
    return canonical_store_url(url)


class PulseBackend(KeyValueStoreBackend, StoreResults):  # type: ignore[misc]
    """Celery results in the pulse store (``pulse://``)."""

    key_t = str
    implements_incr = True
    #: Expired rows read as absent at once and are purged with the finished claims:
    #: Celery need not schedule ``celery.backend_cleanup``.
    supports_autoexpire = True
    #: Joins read every part in one query (``mget``), not one per part.
    supports_native_join = True

    def __init__(self, app: Any = None, url: str | None = None, **kwargs: Any) -> None:
        super().__init__(app=app, url=url, **kwargs)
        self.url = url or "pulse://"
        self.store_url = store_url_for(url, self.app.conf)
        self._rows_by_pid: tuple[int, Any] | None = None
        self._lock = threading.Lock()
        self._extended_conf: bool | None = None
        self._json: Any = None  # kombu's JSON encoder, False when another path applies

    @property
    def rows(self) -> Any:
        """This process's table handle: a forked child makes its own engine, never
        sharing the parent's connections."""
        held = self._rows_by_pid
        if held is not None and held[0] == os.getpid():
            return held[1]
        with self._lock:
            held = self._rows_by_pid
            if held is None or held[0] != os.getpid():
                from celery_pulse.store.sql.engine import EngineOptions, make_engine
                from celery_pulse.store.sql.results import ResultRows

                conf = self.app.conf
                engine = make_engine(self.store_url, EngineOptions(
                    role="backend", pooler=conf.get("pulse_store_pooler") or "auto",
                    listen_url=conf.get("pulse_store_listen_url")))
                held = self._rows_by_pid = (os.getpid(), ResultRows(engine))
        return held[1]

    def opened_here(self) -> bool:
        """Whether this process has opened the store (a -P pulse pool child never does)."""
        held = self._rows_by_pid
        return held is not None and held[0] == os.getpid()

    def as_uri(self, include_password: bool = False) -> str:
        if self.url == "pulse://":
            return self.url
        return "pulse+" + (self.store_url if include_password else mask_url(self.store_url))

    def __reduce__(self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                   ) -> Any:
        kwargs = dict(kwargs or {}, url=self.url)
        return super().__reduce__(args, kwargs)

    # -- the key-value operations Celery's base class is written against ------------------
    def get(self, key: str) -> bytes | None:
        value: bytes | None = self.rows.get(key)
        return value

    def mget(self, keys: list[str]) -> list[bytes | None]:
        values: list[bytes | None] = self.rows.mget([str(k) for k in keys])
        return values

    def set(self, key: str, value: bytes | str) -> None:
        self._set_with_state(key, value, None)

    def _set_with_state(self, key: str, value: bytes | str, state: str | None) -> None:
        data = value.encode() if isinstance(value, str) else value
        is_task = key.startswith(self.task_keyprefix)
        self.rows.set(key, data, state=state if is_task else None, expires=self.expires,
                      final=states.SUCCESS if is_task else None)

    def delete(self, key: str) -> None:
        self.rows.delete([key])

    def incr(self, key: str) -> int:
        if _precounted.value is not None:  # counted already, with the part's completion
            counted, _precounted.value = _precounted.value, None
            return counted
        value: int = self.rows.incr(key, self.chord_expires)
        return value

    # -- chords under -P pulse: counted with the parts' completions ----------------------
    def on_chord_part_return(self, request: Any, state: str, result: Any, **kwargs: Any
                             ) -> None:
        """In a ``-P pulse`` pool child: not counted here but handed to the parent with
        the part's outcome (:func:`deferred_result`); elsewhere as Celery counts."""
        if _deferral.task_id is None or _deferral.task_id != getattr(request, "id", None):
            super().on_chord_part_return(request, state, result, **kwargs)
            return
        if not getattr(request, "group", None):
            return
        part = {"id": request.id, "group": request.group, "chord": request.chord}
        record = _deferral.record or ResultRecord(
            self.get_key_for_task(request.id), None, state,
            float(self.expires) if self.expires else None, states.SUCCESS)
        note = self.encode({"group": request.group, "chord": request.chord})
        _deferral.record = dataclasses.replace(
            record, counter=self.get_key_for_chord(request.group),
            counter_note=note.encode() if isinstance(note, str) else note)
        _deferral.chord = part

    def finish_chord(self, part: dict[str, Any], count: int, nonce: str) -> bool:
        """In the worker's parent, after a part's completion counted it (``count``): if
        that made the chord whole, join its parts and publish its callback, as Celery's
        ``on_chord_part_return`` does (errors included), once. Returns whether it did.

        The callback is published as the publication ``chord:<group>:<nonce>``: should a
        recovery publish it again (this worker died before deleting the counter), the
        workers run it once.
        """
        from celery.app.task import Context
        from celery.result import GroupResult

        chord = dict(part["chord"] or {})
        size = chord.get("chord_size")
        if size is None:
            deps = GroupResult.restore(part["group"], backend=self)
            if deps is None:
                # Finished already: the parts of one exchange come here in task id order,
                # not in count order, so the last count may have been first. (Or expired,
                # with its count: nothing left to finish.)
                return False
            size = len(deps)
        if count != size:
            return False
        options = dict(chord.get("options") or {})
        options["headers"] = {**dict(options.get("headers") or {}),
                              FIXED_PUBLICATION_HEADER: f"chord:{part['group']}:{nonce}"}
        chord["options"] = options
        request = Context({**part, "chord": chord})
        _precounted.value = count
        try:
            super().on_chord_part_return(request, states.SUCCESS, None)
        finally:
            _precounted.value = None
        return True

    def recover_chords(self, older_than: float, limit: int = 100) -> int:
        """Finish chords whose last part was counted but whose callback was not published
        (the worker died in between): counters untouched for ``older_than`` seconds. A
        count not yet whole is left alone. Returns how many were finished."""
        finished = 0
        prefix = self.chord_keyprefix
        for _key, count, nonce, note in self.rows.stale_counters(prefix, older_than, limit):
            if note is None:
                continue
            saved = self.decode(note)
            part = {"id": None, "group": saved["group"], "chord": saved["chord"]}
            if self.finish_chord(part, count, nonce):
                finished += 1
        return finished

    def expire(self, key: str, value: float | None) -> None:
        self.rows.expire(key, value)

    def wait_for(self, task_id: str, timeout: float | None = None, interval: float = 0.5,
                 no_ack: bool = True, on_interval: Any = None) -> Any:
        """``AsyncResult.get()``: woken by the write's commit on PostgreSQL (LISTEN/NOTIFY,
        ``interval`` only as a safety poll); elsewhere polling from 5 ms, doubling up to
        ``interval``."""
        self._ensure_not_eager()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.rows.watch([self.get_key_for_task(task_id)]) as watch:
            while True:
                meta = self.get_task_meta(task_id)
                if meta["status"] in states.READY_STATES:
                    if on_interval:
                        # A parent's error (a chord header's) is raised first, as Celery's
                        # async backends raise it: the chord's ChordError may be written
                        # before the waiter wakes.
                        on_interval()
                    return meta
                if on_interval:
                    on_interval()
                left = interval if deadline is None else min(interval,
                                                             deadline - time.monotonic())
                if left <= 0:
                    raise CeleryTimeoutError("The operation timed out.")
                watch.wait(left)

    def cleanup(self) -> None:
        """``celery.backend_cleanup``: delete expired rows now (retention does it too)."""
        while self.rows.purge_expired():
            pass

    def exception_safe_to_retry(self, exc: BaseException) -> bool:
        """With ``result_backend_always_retry``: an unreachable store is retried."""
        return isinstance(exc, StoreUnavailable)

    def store_result(self, task_id: str, result: Any, state: str, traceback: Any = None,
                     request: Any = None, **kwargs: Any) -> Any:
        """In a ``-P pulse`` pool child, an attempt's outcome is kept for the parent
        (:func:`deferred_result`): nothing is written, so Celery's retry wrapper has
        nothing to retry, and the child skips it (it runs once per task)."""
        if _deferral.task_id != task_id or state not in DEFERRED_STATES:
            return super().store_result(task_id, result, state, traceback, request, **kwargs)
        result = self.encode_result(result, state)
        meta = self._get_result_meta(result=result, state=state, traceback=traceback,
                                     request=request)
        meta["task_id"] = str(task_id)
        value = self.encode(meta)
        _deferral.record = ResultRecord(
            self.get_key_for_task(task_id), value.encode() if isinstance(value, str) else value,
            state, float(self.expires) if self.expires else None, states.SUCCESS)
        return result

    def _store_result(self, task_id: str, result: Any, state: str, traceback: Any = None,
                      request: Any = None, **kwargs: Any) -> Any:
        """One statement: the upsert itself keeps a success final (Celery's key-value
        backends read the row first, and a write between the two could still replace it)."""
        meta = self._get_result_meta(result=result, state=state, traceback=traceback,
                                     request=request)
        meta["task_id"] = str(task_id)
        self._set_with_state(self.get_key_for_task(task_id), self.encode(meta), state)
        return result

    # -- the per-task cost of a result (every task of a pool child builds one) ------------
    def _get_result_meta(self, result: Any, state: str, traceback: Any, request: Any,
                         format_date: bool = True, encode: bool = False) -> dict[str, Any]:
        """Celery's meta, built without its per-call config lookup (``result_extended``
        is read once) and with the date taken in the app's timezone directly (Celery's
        ``app.now()`` converts through UTC with an ambiguity check): the same keys and
        values, about half the cost. ``result_extended`` takes Celery's own path."""
        if self._extended():
            meta: dict[str, Any] = super()._get_result_meta(
                result, state, traceback, request, format_date=format_date, encode=encode)
            return meta
        date_done: Any = None
        if state in self.READY_STATES:
            date_done = datetime.now(self.app.timezone)
            if format_date:
                date_done = date_done.isoformat()
        meta = {"status": state, "result": result, "traceback": traceback,
                "children": self.current_task_children(request), "date_done": date_done}
        if request:
            group, parent = getattr(request, "group", None), getattr(request, "parent_id", None)
            if group:
                meta["group_id"] = group
            if parent:
                meta["parent_id"] = parent
        return meta

    def _extended(self) -> bool:
        extended = self._extended_conf
        if extended is None:
            extended = self._extended_conf = bool(
                self.app.conf.find_value_for_key("extended", "result"))
        return extended

    def encode(self, data: Any) -> Any:
        """JSON straight through kombu's own encoder when that is the serializer (what
        kombu's registry would call, minus its lookup); anything else as Celery does."""
        if self._json is None:
            self._json = _plain_json_encoder(self.serializer, self.compression)
        if self._json is False:
            return super().encode(data)
        try:
            return self._json.encode(data)
        except Exception as exc:  # as kombu's registry reraises: the tracer handles it
            raise EncodeError(exc) from exc

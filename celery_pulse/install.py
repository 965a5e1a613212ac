"""Wire pulse into a Celery app: bootsteps and the ``pulse`` pool name."""

from __future__ import annotations

import contextlib
from typing import Any

POOL_ALIAS = "pulse"
#: The module's last part is what Celery's banner shows (``concurrency: 2 (pulse_prefork)``);
#: "prefork" in its path is what Django's fixup looks for.
POOL_CLASS = "celery_pulse.pool.pulse_prefork:TaskPool"
#: The one line a ``-P pulse`` worker of an app without :func:`install` exits with.
NOT_INSTALLED = ("-P pulse on an app without the pulse bootsteps would run plain prefork "
                 "(no leases): call celery_pulse.install(app) in the module that creates "
                 "the app")


def register_pool_alias() -> None:
    """Make ``pulse`` a pool name for ``worker_pool`` and for ``-P`` on the real CLI.

    ``-P`` is a click Choice whose values were fixed when ``celery.bin.worker`` was
    imported; the ``celery.commands`` entry point (our ``celery pulse`` group)
    imports us right after, so extending that Choice here makes ``-P pulse`` valid.
    Idempotent, and it tolerates a Celery whose internals moved (then only
    ``worker_pool = "pulse"`` and ``-P custom`` keep working).
    """
    from celery import concurrency

    concurrency.ALIASES.setdefault(POOL_ALIAS, POOL_CLASS)
    import sys

    worker_cli = sys.modules.get("celery.bin.worker")
    choice = getattr(worker_cli, "WORKERS_POOL", None)
    choices = getattr(choice, "choices", None)
    if choices is not None and POOL_ALIAS not in choices:
        with contextlib.suppress(AttributeError, TypeError):  # Celery internals moved
            choice.choices = (*tuple(choices), POOL_ALIAS)  # type: ignore[union-attr]


def installed(app: Any) -> bool:
    """Whether :func:`install` added pulse's worker step to ``app``."""
    from celery_pulse.bootsteps.runtime import Runtime

    return Runtime in app.steps["worker"]


def mask_secrets_in_conf() -> None:
    """Make Celery's own display of settings mask the passwords in pulse's URLs.

    ``celery inspect conf`` (answered by every worker to anyone on the broker), ``celery
    report`` and Flower show ``app.conf.table()``, which Celery filters through
    ``celery.app.utils.filter_hidden_settings``: it masks Celery's own keys only, so
    ``pulse_store_url`` went out with its password. We wrap that function (it is looked
    up at call time) to mask any pulse setting's URL password too. Idempotent; a Celery
    without the function is left alone.
    """
    from celery.app import utils

    from celery_pulse.store_urls import masked_value

    original = getattr(utils, "filter_hidden_settings", None)
    if original is None or getattr(original, "pulse_masks", False):
        return

    def filter_hidden_settings(conf: Any) -> Any:
        shown = original(conf)
        return {key: masked_value(key, value) for key, value in shown.items()}

    filter_hidden_settings.pulse_masks = True  # type: ignore[attr-defined]
    utils.filter_hidden_settings = filter_hidden_settings


def _warn_on_celery_beat(app: Any) -> None:
    """Celery's own beat next to pulse's doubles every slot: say so (not a crash)."""
    from celery.signals import beat_init

    def warn(sender: Any = None, **_kwargs: Any) -> None:
        if getattr(sender, "app", app) is app and app.conf.get("pulse_beat", True):
            import logging

            logging.getLogger("celery_pulse").warning(
                "pulse: `celery beat` is starting while pulse's leader-elected beat is on "
                "(pulse_beat=True): every slot may fire twice. Use `celery pulse beat` "
                "instead, or set pulse_beat = False.")

    beat_init.connect(warn, weak=False, dispatch_uid=f"celery-pulse-beat-warning-{id(app)}")


def stamp_publication(headers: Any = None, **_kwargs: Any) -> None:
    """``before_task_publish``: give every publication of a task an identity of its own.

    A redelivery of one message carries the same ``pulse_pub`` (and Recover re-publishes
    the stored message with it), a new publication of the same task id (``Task.replace``,
    a retry, a signature applied again, a fixed ``task_id``) a new one: the first is a
    duplicate, the second a new run once the previous run has ended. A publisher that
    names the publication itself (``pulse_pub_fixed``: a beat slot) keeps that name.
    """
    import uuid

    from celery_pulse.messages import FIXED_PUBLICATION_HEADER, PUBLICATION_HEADER

    if isinstance(headers, dict) and headers.get("id"):  # task protocol 2
        fixed = headers.pop(FIXED_PUBLICATION_HEADER, None)
        headers[PUBLICATION_HEADER] = str(fixed) if fixed else uuid.uuid4().hex


def configure_gateway_worker(app: Any) -> None:
    """With ``pulse_gateway_url``, the app's broker is the gateway (``pulsegw://``) and
    what needs a broker of one's own is off: events, mingle and gossip. Remote control
    stays on for the ``revoke`` messages the gateway passes on (gateway/cancels.py)."""
    from kombu.transport import TRANSPORT_ALIASES

    TRANSPORT_ALIASES.setdefault("pulsegw", "celery_pulse.gateway.transport:Transport")
    url = app.conf.get("pulse_gateway_url")
    if not url:
        return
    options = dict(app.conf.broker_transport_options or {})
    options["gateway_url"] = url
    app.conf.update(broker_url="pulsegw://", broker_transport_options=options,
                    result_backend="celery_pulse.gateway.results:GatewayBackend",
                    worker_send_task_events=False,
                    task_send_sent_event=False, broker_connection_retry_on_startup=True)


def install(app: Any) -> Any:
    """Add the pulse bootsteps to ``app`` and the ``pulse`` pool name. Idempotent.

    The steps only switch on in a worker whose pool is the pulse pool
    (``-P pulse`` or ``worker_pool = "pulse"``); other pools run as plain Celery.
    """
    from celery.signals import before_task_publish

    from celery_pulse.bootsteps.registry import Registry
    from celery_pulse.bootsteps.runtime import Runtime

    register_pool_alias()
    mask_secrets_in_conf()
    _warn_on_celery_beat(app)
    before_task_publish.connect(stamp_publication, weak=False,
                                dispatch_uid="celery-pulse-publication")
    if str(app.conf.broker_url or "").startswith("filesystem"):
        from celery_pulse.embedded import atomic_filesystem_puts

        atomic_filesystem_puts()  # kombu#1551: a half-written message kills a consumer
    configure_gateway_worker(app)
    app.Task.Strategy = "celery_pulse.strategy:factory"
    app.steps["worker"].add(Runtime)
    app.steps["consumer"].add(Registry)
    return app

"""Pulse's pages added to a Flower application: handlers, templates, the store.

:func:`extend` is the one entry: it takes a built ``flower.app.Flower`` and adds pulse's
handlers (rewritten under Flower's ``--url_prefix`` as Flower rewrites its own), the
template loader that adds "Pulse" to Flower's navigation, and the app's pulse store
(opened on first use). ``celery pulse flower`` calls it; so can a deployment that builds
its Flower in Python. :class:`PulseFlower` is Flower with :func:`extend` applied.
"""

from __future__ import annotations

from typing import Any

from flower.app import Flower, rewrite_handler
from flower.urls import settings as flower_settings
from tornado.web import url

from celery_pulse.flower import claims, cluster, review
from celery_pulse.flower.base import PulseContext
from celery_pulse.flower.templates import PulseLoader

#: Every pulse route: pages under ``/pulse``, the JSON API under ``/api/pulse``.
HANDLERS = [
    url(r"/pulse", claims.ClaimsPage, name="pulse"),
    url(r"/pulse/claims", claims.ClaimsPage, name="pulse-claims"),
    url(r"/pulse/claim/(.+)", claims.ClaimPage, name="pulse-claim"),
    url(r"/pulse/review", review.ReviewPage, name="pulse-review"),
    url(r"/pulse/review/action", review.ReviewAction, name="pulse-review-action"),
    url(r"/pulse/workers", cluster.WorkersPage, name="pulse-workers"),
    url(r"/pulse/workers/drain", cluster.DrainAction, name="pulse-drain"),
    url(r"/pulse/leader", cluster.LeaderPage, name="pulse-leader"),
    url(r"/pulse/permits", cluster.PermitsPage, name="pulse-permits"),
    (r"/api/pulse/claims", claims.ClaimsApi),
    (r"/api/pulse/claim/(.+)", claims.ClaimApi),
    (r"/api/pulse/review", review.ReviewApi),
    (r"/api/pulse/review/(retry|resolve)", review.ReviewActionApi),
    (r"/api/pulse/workers", cluster.WorkersApi),
    (r"/api/pulse/worker/(drain|undrain)/(.+)", cluster.DrainApi),
    (r"/api/pulse/leader", cluster.LeaderApi),
    (r"/api/pulse/permits", cluster.PermitsApi),
]


def extend(flower: Any) -> Any:
    """Add pulse's pages, API and navigation item to ``flower`` (before it serves)."""
    prefix = getattr(flower.options, "url_prefix", "") or ""
    handlers = [rewrite_handler(h, prefix) for h in HANDLERS] if prefix else list(HANDLERS)
    # Before Flower's own rules: its last one answers 404 to every path.
    flower.add_handlers(r".*", handlers)
    # Flower's own folder unless the deployment gave its application another.
    flower.settings["template_loader"] = PulseLoader(
        flower.settings.get("template_path") or flower_settings["template_path"],
        **_loader_options(flower.settings))
    flower.settings["pulse"] = PulseContext(flower.capp)
    return flower


def _loader_options(settings: dict[str, Any]) -> dict[str, Any]:
    """The loader options tornado would give its own loader from the settings."""
    options = {}
    if "autoescape" in settings:
        options["autoescape"] = settings["autoescape"]
    if "template_whitespace" in settings:
        options["whitespace"] = settings["template_whitespace"]
    return options


class PulseFlower(Flower):
    """Flower with pulse's pages: build it as you build ``flower.app.Flower``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extend(self)

    def stop(self) -> None:
        super().stop()
        context = self.settings.get("pulse")
        if isinstance(context, PulseContext):
            context.close()

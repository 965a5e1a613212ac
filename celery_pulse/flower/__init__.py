"""The Pulse page inside Flower: claims, the review queue, workers, leader and beat, permits.

Flower has no plugin API, but it is a Tornado application: :func:`extend` adds pulse's
handlers, templates and navigation item to one, with Flower's own auth, XSRF and
``--url_prefix``. ``celery -A proj pulse flower [Flower's options]`` starts Flower so
extended (:mod:`celery_pulse.cli.flower`).

* :mod:`.app`: :func:`extend`, :class:`PulseFlower`, the routes;
* :mod:`.base`: what every handler shares (the store, filters, who acts, errors);
* :mod:`.claims`, :mod:`.review`, :mod:`.cluster`: one module per page family, each page
  with its JSON twin under ``/api/pulse``;
* :mod:`.templates`: pulse's templates beside Flower's, "Pulse" in Flower's navbar.

Importing this package imports Flower (an optional dependency: ``pip install flower``).
"""

from __future__ import annotations

from celery_pulse.flower.app import HANDLERS, PulseFlower, extend

__all__ = ["HANDLERS", "PulseFlower", "extend"]

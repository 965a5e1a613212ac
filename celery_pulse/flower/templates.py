"""Pulse's templates beside Flower's, without forking Flower's.

One loader serves the whole Flower application: a name found in pulse's folder
(``pulse_*.html``) comes from there, any other from Flower's own folder, so pulse's
pages extend Flower's ``base.html`` and look like the rest of Flower. Flower's
``navbar.html`` is read as Flower ships it and gets one more item, "Pulse", before the
end of its first list (the primary navigation): every page, Flower's and pulse's, shows
it. A navbar whose shape we don't recognise is served unchanged (the pages stay
reachable at ``/pulse``), never broken.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from tornado.template import Loader, Template

logger = logging.getLogger(__name__)

#: Pulse's templates (package data).
TEMPLATES = os.path.join(os.path.dirname(__file__), "templates")
NAVBAR = "navbar.html"
NAV_ITEM = "pulse_navitem.html"
#: The end of the navbar's first list: the primary navigation.
NAV_END = b"</ul>"


class PulseLoader(Loader):
    """Looks in pulse's folder first, then in Flower's (``root_directory``)."""

    def __init__(self, flower_templates: str, **kwargs: Any) -> None:
        super().__init__(flower_templates, **kwargs)

    def _create_template(self, name: str) -> Template:
        own = os.path.join(TEMPLATES, name)
        if name != NAVBAR and os.path.isfile(own):
            with open(own, "rb") as fh:
                return Template(fh.read(), name=name, loader=self)
        with open(os.path.join(self.root, name), "rb") as fh:
            text = fh.read()
        if name == NAVBAR:
            text = with_pulse_item(text)
        return Template(text, name=name, loader=self)


def with_pulse_item(navbar: bytes) -> bytes:
    """Flower's navbar with the Pulse item at the end of its primary navigation."""
    at = navbar.find(NAV_END)
    if at < 0:
        logger.warning("pulse: Flower's navbar has no list to add 'Pulse' to; the pulse "
                       "pages are still served under /pulse")
        return navbar
    with open(os.path.join(TEMPLATES, NAV_ITEM), "rb") as fh:
        item = fh.read()
    return navbar[:at] + item + navbar[at:]

"""Store URLs that no retry can fix, one per way a first connection fails for good,
for the start-up tests (tests/integration/test_store_open.py, acceptance/test_store_startup.py).

Each case: the URL, the services it needs, and the words the error must contain (the
database, user or host the driver names). Where the URL can carry a password, it holds
:data:`PASSWORD`, which no message may show. PostgreSQL's test server trusts every
local login (a password is never asked), so its authentication case is a role that
does not exist; MariaDB's root has no password, so a wrong one is refused.
"""

from __future__ import annotations

import dataclasses
import uuid

import sqlalchemy as sa

from tests.helpers import services

PASSWORD = "s3cret-pw"
UNKNOWN_HOST = "no-such-host.invalid"  # RFC 2606: never resolves


@dataclasses.dataclass(frozen=True)
class BadStore:
    id: str
    service: str
    url: str
    names: str  # what the message must say


def _on(admin_url: str, **parts: str) -> str:
    return sa.make_url(admin_url).set(**parts).render_as_string(hide_password=False)


def cases() -> list[BadStore]:
    missing = f"pt_missing_{uuid.uuid4().hex[:8]}"
    role = f"pt_nobody_{uuid.uuid4().hex[:8]}"
    pg, my = services.PG_ADMIN_URL, services.MARIADB_ADMIN_URL
    return [
        BadStore("pg-no-database", "postgres", _on(pg, password=PASSWORD, database=missing),
                 f'database "{missing}" does not exist'),
        BadStore("pg-unknown-role", "postgres", _on(pg, username=role, password=PASSWORD),
                 f'role "{role}" does not exist'),
        BadStore("pg-unknown-host", "postgres", _on(pg, password=PASSWORD, host=UNKNOWN_HOST),
                 UNKNOWN_HOST),
        BadStore("mariadb-no-database", "mariadb", _on(my, database=missing),
                 f"Unknown database '{missing}'"),
        BadStore("mariadb-wrong-password", "mariadb", _on(my, password=PASSWORD),
                 "Access denied for user 'root'"),
        BadStore("mariadb-unknown-host", "mariadb", _on(my, password=PASSWORD,
                                                        host=UNKNOWN_HOST), UNKNOWN_HOST),
    ]


CASES = cases()

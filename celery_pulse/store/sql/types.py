"""Column types and table options that must differ on MySQL/MariaDB, shared by the table
definitions and the migrations.

MySQL's ``TEXT``/``BLOB`` stop at 64 KiB (a Celery chain's headers or a message body can
be larger): the long variants there. Identifiers compare byte for byte, as on the other
stores (``utf8mb4_bin``; the server default collation ignores case).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

#: Store-clock seconds since the epoch (``DOUBLE`` on MySQL, which SQLAlchemy's
#: ``Float(53)`` becomes there anyway; named so that schema comparison agrees).
SECONDS = sa.Float(precision=53).with_variant(mysql.DOUBLE(asdecimal=False), "mysql", "mariadb")
TEXT = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
BLOB = sa.LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")
#: Keyword arguments of every ``Table``/``create_table``.
TABLE_OPTIONS: dict[str, Any] = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4",
                 "mysql_collate": "utf8mb4_bin"}

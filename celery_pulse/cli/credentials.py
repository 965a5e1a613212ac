"""``celery pulse credentials create|list|rotate|revoke``: who may lease tasks through a
gateway.

The store keeps a credential's digest, never its token: ``create`` and ``rotate`` show
(or write to a new 0600 file) the token once, and nothing can show it again. A
credential may expire (``--expires-in``); a rotation keeps the secret before it valid
for a grace period (``--grace``), so the workers' files can be replaced one by one.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import click

from celery_pulse.cli.context import echo_json, opened_store, who
from celery_pulse.store.credentials import CONNECT, CONSUME, Credential


def _credential_payload(c: Credential) -> dict[str, Any]:
    """A credential as shown: everything but a secret (the store has none to show)."""
    return {"credential_id": c.credential_id, "name": c.name, "scopes": sorted(c.scopes),
            "queues": list(c.queues), "active": c.active, "created_at": c.created_at,
            "created_by": c.created_by, "revoked_at": c.revoked_at, "revoked_by": c.revoked_by,
            "expires_at": c.expires_at, "expired": c.expired, "rotated_at": c.rotated_at,
            "rotated_by": c.rotated_by, "previous_secret_until": c.previous_until}


class Duration(click.ParamType):  # type: ignore[type-arg]
    """Seconds, or a number with ``s``, ``m``, ``h`` or ``d``: ``90``, ``15m``, ``30d``."""

    name = "duration"
    UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        text = str(value).strip().lower()
        unit = self.UNITS.get(text[-1:], None)
        number = text[:-1] if unit is not None else text
        try:
            seconds = float(number) * (unit or 1)
        except ValueError:
            self.fail(f"{value!r} is not a duration (90, 90s, 15m, 12h, 30d)", param, ctx)
        if not seconds >= 0 or seconds == float("inf"):
            self.fail(f"{value!r} is not a duration of 0 or more", param, ctx)
        return seconds


def _write_token(fd: int | None, output: str | None, record: Credential, token: str,
                 done: str) -> None:
    """The token, shown this once on stdout, or into the new 0600 file ``output``."""
    if fd is None:
        click.echo(f"credential {record.name} ({record.credential_id}) {done}; its token, "
                   f"shown this once:", err=True)
        click.echo(token)
        return
    with os.fdopen(fd, "w") as fh:
        json.dump({"credential_id": record.credential_id, "name": record.name,
                   "token": token}, fh)
        fh.write("\n")
    click.echo(f"credential {record.name} ({record.credential_id}) {done}; token written to "
               f"{output}")


def _open_private(path: str) -> int:
    """A new file only its owner can read; an existing file is never overwritten (it may
    be another credential's, or readable by others)."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise click.ClickException(f"{path} exists: not overwriting it (remove it, or choose "
                                   f"another --output)") from None
    except OSError as exc:
        raise click.ClickException(f"cannot write {path}: {exc.strerror}") from None


@click.group()
def credentials() -> None:
    """Lease gateway credentials: create (the token is shown once), list, rotate, revoke."""


@credentials.command("create")
@click.argument("name")
@click.option("--queue", "queues", multiple=True, help="A queue it may consume (repeat).")
@click.option("--scope", "scopes", multiple=True,
              help="workers:connect or workers:consume (repeat; default both).")
@click.option("--output", default=None, type=click.Path(dir_okay=False),
              help="Write a JSON credentials file (mode 0600) instead of printing the token.")
@click.option("--expires-in", default=None, type=Duration(),
              help="It stops authenticating this long from now, by the store's clock "
                   "(90s, 15m, 12h, 30d; default: never).")
@click.pass_context
def credentials_create(ctx: click.Context, name: str, queues: tuple[str, ...],
                       scopes: tuple[str, ...], output: str | None,
                       expires_in: float | None) -> None:
    """Create credential NAME: its token is shown (or written) once, never again."""
    fd = _open_private(output) if output else None
    try:
        with opened_store(ctx) as store:
            record, token = store.credentials.create_credential(
                name, scopes or (CONNECT, CONSUME), queues, who(), expires_in)
    except BaseException:
        if fd is not None and output:
            os.close(fd)
            os.unlink(output)
        raise
    _write_token(fd, output, record, token, "created")


@credentials.command("rotate")
@click.argument("name_or_id")
@click.option("--grace", default="1h", show_default=True, type=Duration(),
              help="How long the secret it had stays valid beside the new one (0: not at "
                   "all).")
@click.option("--output", default=None, type=click.Path(dir_okay=False),
              help="Write a JSON credentials file (mode 0600) instead of printing the token.")
@click.pass_context
def credentials_rotate(ctx: click.Context, name_or_id: str, grace: float,
                       output: str | None) -> None:
    """Give a credential a new secret (same id, scopes and sessions): the new token is
    shown (or written) once; the old one works for --grace more."""
    fd = _open_private(output) if output else None
    try:
        with opened_store(ctx) as store:
            record, token = store.credentials.rotate_credential(name_or_id, who(), grace)
    except BaseException:
        if fd is not None and output:
            os.close(fd)
            os.unlink(output)
        raise
    _write_token(fd, output, record, token, f"rotated (the previous token works for "
                                            f"{grace:g} s more)")


@credentials.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def credentials_list(ctx: click.Context, as_json: bool) -> None:
    """Every credential, revoked ones too (never a secret)."""
    with opened_store(ctx) as store:
        rows = [_credential_payload(c) for c in store.credentials.list_credentials()]
    if as_json:
        echo_json(rows)
        return
    if not rows:
        click.echo("no credentials")
        return
    width = max(len(r["name"]) for r in rows)
    click.echo(f"{'NAME':<{width}}  {'ID':<32}  {'STATE':<7}  SCOPES / QUEUES")
    for r in rows:
        state = ("active" if r["active"] else "expired" if r["revoked_at"] is None
                 else "revoked")
        notes = []
        if r["revoked_at"] is not None:
            notes.append(f"revoked by {r['revoked_by']}")
        elif r["expires_at"] is not None:
            notes.append(f"{'expired' if r['expired'] else 'expires'} "
                         f"{_when(r['expires_at'])}")
        if r["rotated_at"] is not None:
            notes.append(f"rotated {_when(r['rotated_at'])} by {r['rotated_by']}")
        click.echo(f"{r['name']:<{width}}  {r['credential_id']}  {state:<7}  "
                   f"{','.join(r['scopes'])} / {','.join(r['queues']) or '-'}"
                   + (f"  ({'; '.join(notes)})" if notes else ""))


def _when(at: float) -> str:
    return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@credentials.command("revoke")
@click.argument("name_or_id")
@click.pass_context
def credentials_revoke(ctx: click.Context, name_or_id: str) -> None:
    """Revoke a credential for good: its token is refused from now on."""
    with opened_store(ctx) as store:
        record = store.credentials.revoke_credential(name_or_id, who())
    click.echo(f"credential {record.name} ({record.credential_id}) revoked by "
               f"{record.revoked_by}")

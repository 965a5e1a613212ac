"""``celery pulse credentials create|list|revoke``: who may lease tasks through a gateway.

The store keeps a credential's digest, never its token: ``create`` shows (or writes to a
new 0600 file) the token once, and nothing can show it again.
"""

from __future__ import annotations

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
            "created_by": c.created_by, "revoked_at": c.revoked_at, "revoked_by": c.revoked_by}


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
    """Lease gateway credentials: create (the token is shown once), list, revoke."""


@credentials.command("create")
@click.argument("name")
@click.option("--queue", "queues", multiple=True, help="A queue it may consume (repeat).")
@click.option("--scope", "scopes", multiple=True,
              help="workers:connect or workers:consume (repeat; default both).")
@click.option("--output", default=None, type=click.Path(dir_okay=False),
              help="Write a JSON credentials file (mode 0600) instead of printing the token.")
@click.pass_context
def credentials_create(ctx: click.Context, name: str, queues: tuple[str, ...],
                       scopes: tuple[str, ...], output: str | None) -> None:
    """Create credential NAME: its token is shown (or written) once, never again."""
    fd = _open_private(output) if output else None
    try:
        with opened_store(ctx) as store:
            record, token = store.credentials.create_credential(
                name, scopes or (CONNECT, CONSUME), queues, who())
    except BaseException:
        if fd is not None and output:
            os.close(fd)
            os.unlink(output)
        raise
    if fd is None:
        click.echo(f"credential {record.name} ({record.credential_id}) created; its token, "
                   f"shown this once:", err=True)
        click.echo(token)
        return
    with os.fdopen(fd, "w") as fh:
        json.dump({"credential_id": record.credential_id, "name": record.name,
                   "token": token}, fh)
        fh.write("\n")
    click.echo(f"credential {record.name} ({record.credential_id}) created; token written to "
               f"{output}")


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
        click.echo(f"{r['name']:<{width}}  {r['credential_id']}  "
                   f"{'active' if r['active'] else 'revoked':<7}  "
                   f"{','.join(r['scopes'])} / {','.join(r['queues']) or '-'}"
                   + ("" if r["active"] else f"  (revoked by {r['revoked_by']})"))


@credentials.command("revoke")
@click.argument("name_or_id")
@click.pass_context
def credentials_revoke(ctx: click.Context, name_or_id: str) -> None:
    """Revoke a credential for good: its token is refused from now on."""
    with opened_store(ctx) as store:
        record = store.credentials.revoke_credential(name_or_id, who())
    click.echo(f"credential {record.name} ({record.credential_id}) revoked by "
               f"{record.revoked_by}")

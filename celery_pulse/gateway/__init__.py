"""The pulse.worker.v1 gateway and its client: remote workers hold leases over a WebSocket,
with no database or broker credentials of their own.

Three rooms, split the way websockets splits its sans-I/O protocol from its asyncio shell:

* **The protocol core**, with no I/O, no Celery and no SQL: :mod:`.protocol` (constants,
  error codes, records), :mod:`.wire` (strict JSON and typed fields), :mod:`.frames` (the
  codec, and the protocol's public face), :mod:`.session` (identity, generations,
  capacity, idempotency), :mod:`.receipts` (how the gateway's answers are spelled) and
  :mod:`.replies` (what a worker makes of them). The credentials a handshake checks are
  a store contract, :mod:`celery_pulse.store.credentials`.
* **The server** (``celery pulse gateway``): :mod:`.server` (the handshake and each
  connection), :mod:`.link` (a connection's bounded writer, its limits, TLS),
  :mod:`.operations` (what an accepted operation does, and dispatch), :mod:`.rounds`
  (one holder's starts and finishes applied together), :mod:`.dispatch`
  (the feeder and the fenced store calls), :mod:`.outcomes` (a finish in the app's result
  backend), :mod:`.presence` (the worker registry) and :mod:`.events` (Celery events).
* **The remote-worker side**: :mod:`.client` (one instance's connection, across
  reconnects), :mod:`.worker` (a ``-P pulse`` worker's store over it), :mod:`.transport`
  (the ``pulsegw://`` broker) and :mod:`.results` (its result backend).

The server and the remote-worker side share the core and never import each other; the
contracts in pyproject.toml's ``[tool.importlinter]`` keep it so.
"""

"""The pulse.worker.v1 gateway and its client: remote workers hold leases over a WebSocket,
with no database or broker credentials of their own."""

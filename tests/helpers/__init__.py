"""Test helpers: services, private PostgreSQL, worker processes."""

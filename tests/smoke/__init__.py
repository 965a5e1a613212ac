"""Smoke tests that run outside pytest, in a venv holding only the published extras."""

"""Shared pytest setup: object-store servers (tests/stores.py) and Prefect servers (tests/prefect_server.py)."""

pytest_plugins = ["tests.stores", "tests.prefect_server"]

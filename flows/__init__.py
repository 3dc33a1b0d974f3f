"""Prefect flows: composition of tasks only, no logic of their own."""

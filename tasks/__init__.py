"""Prefect tasks: retries, caching, artifacts and logging around one library call each."""

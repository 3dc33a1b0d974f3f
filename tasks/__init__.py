"""Prefect tasks: retries, caching, artifacts and logging around one library call each.

No task carries tags. Prefect takes a concurrency slot for every tag of every task run (an acquire
and a release on the API, each a write transaction, whether or not a limit exists), and on the
SQLite server that local runs and the tests use, an acquire that meets a concurrent write gets a 503
(SQLite busy) and is retried after 2 s: seconds on a pipeline's critical path, many times a run. Runs are
bounded by the spec instead (``eval.max_concurrent``); task names say what each one is.
"""

"""Typed deployment specs, spec files, work-pool templates and the `tessera` CLI."""

"""Byte units, so that sizes read as ``16 * GiB`` everywhere rather than as a fresh ``2**30``."""

MiB = 2**20
GiB = 2**30

"""Which TCP ports a process tree listens on, read from /proc (Linux): for the loopback-only checks."""

from __future__ import annotations

import ipaddress
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

LISTEN = "0A"  # the TCP state in /proc/net/tcp*


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    argv: str  # the owning process's command line, space-joined

    @property
    def loopback(self) -> bool:
        address = ipaddress.ip_address(self.address)
        mapped = getattr(address, "ipv4_mapped", None)
        return (mapped or address).is_loopback


def _descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    tree, grew = {root}, True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return tree


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # IPv6: four 32-bit words, each in host (little-endian) order
    return str(ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))))


def listeners(root: int) -> set[Listener]:
    """Every TCP socket in LISTEN state owned by ``root`` or any of its descendants."""
    owner: dict[str, int] = {}
    for pid in _descendants(root):
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = fd.readlink().as_posix() if fd.is_symlink() else ""
                if target.startswith("socket:["):
                    owner[target[8:-1]] = pid
        except OSError:
            continue
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != LISTEN or fields[9] not in owner:
                continue
            hex_address, hex_port = fields[1].split(":")
            try:
                argv = Path(f"/proc/{owner[fields[9]]}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                argv = "?"
            found.add(Listener(_address(hex_address), int(hex_port, 16), argv.strip()))
    return found


class ListenerSampler(threading.Thread):
    """Samples ``listeners(root)`` every ``interval_s`` while the ``with`` block runs."""

    def __init__(self, root: int, interval_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.root, self.interval_s = root, interval_s
        self.seen: set[Listener] = set()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.interval_s):
            self.seen |= listeners(self.root)

    def __enter__(self) -> ListenerSampler:
        self.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._done.set()
        self.join()

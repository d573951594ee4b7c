"""A node on a network of its own, which a test can cut off from the database
(docs/ha.md#how-it-is-tested).

`IsolatedNode` creates a network namespace joined to the host by a veth pair. The node runs
inside it (`prefix` before its command) and listens on `node_ip`; the host side has two
addresses: `client_ip` (where the node's clients come from) and `db_ip`, the only address the
node reaches PostgreSQL through (the servers listen on every address). `cut()` installs a
blackhole route to `db_ip` inside the namespace: new connections to the database fail at once
and the packets of open ones go nowhere, while the node's clients still reach it: a partition
between this node and its database, nothing else. `heal()` removes the route. Needs root (or
CAP_NET_ADMIN) and `ip` from iproute2.
"""

from __future__ import annotations

import os
import subprocess

_IP = "ip"


def _ip(*args: str) -> None:
    done = subprocess.run([_IP, *args], capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


class IsolatedNode:
    def __init__(self, index: int = 0) -> None:
        tag = f"{os.getpid() % 100000}{index}"
        self.name = f"paperclip-{tag}"
        self.host_link = f"pch{tag}"[:15]
        self.node_link = f"pcn{tag}"[:15]
        subnet = f"10.231.{(os.getpid() + index) % 250}"
        self.client_ip = f"{subnet}.1"
        self.db_ip = f"{subnet}.2"
        self.node_ip = f"{subnet}.3"
        self.prefix = (_IP, "netns", "exec", self.name)
        self.is_cut = False

    def create(self) -> IsolatedNode:
        _ip("netns", "add", self.name)
        try:
            _ip("link", "add", self.host_link, "type", "veth", "peer", "name", self.node_link)
            _ip("link", "set", self.node_link, "netns", self.name)
            for address in (self.client_ip, self.db_ip):
                _ip("addr", "add", f"{address}/29", "dev", self.host_link)
            _ip("link", "set", self.host_link, "up")
            inside = ("netns", "exec", self.name, _IP)
            _ip(*inside, "addr", "add", f"{self.node_ip}/29", "dev", self.node_link)
            _ip(*inside, "link", "set", self.node_link, "up")
            _ip(*inside, "link", "set", "lo", "up")
        except RuntimeError:
            self.destroy()
            raise
        return self

    def cut(self) -> None:
        _ip("netns", "exec", self.name, _IP, "route", "add", "blackhole", f"{self.db_ip}/32")
        self.is_cut = True

    def heal(self) -> None:
        _ip("netns", "exec", self.name, _IP, "route", "del", "blackhole", f"{self.db_ip}/32")
        self.is_cut = False

    def destroy(self) -> None:
        """Delete the namespace (its end of the veth pair goes with it, and so the host's)."""
        subprocess.run(
            [_IP, "netns", "del", self.name], capture_output=True, timeout=30, check=False
        )
        subprocess.run(
            [_IP, "link", "del", self.host_link], capture_output=True, timeout=30, check=False
        )

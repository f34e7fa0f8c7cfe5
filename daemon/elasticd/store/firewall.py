"""Who may reach the store from this host: an nftables rule that lets only the daemon's own
user open a connection to the store's port.

TCPStore has no authentication, so every record is signed and every secret encrypted
(store/signing.py); this rule keeps the local users and the jobs of this host (which run as
their users) from reaching the store at all.  It is installed by each daemon for its own
host: the store host rejects connections to the port on any of its local addresses, a member
to the store's address.  Root's own processes (and jobs that root submitted, where allowed)
are not stopped by it; nor is a host outside the cluster (keep the port off untrusted
networks; clusters shared by several teams use etcd with client certificates).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import subprocess

from elasticd import trust
from elasticd.errors import ConfigError

log = logging.getLogger(__name__)

KEY = "store.firewall"
_NFT_TIMEOUT = 10.0


def table_name(cluster: str, node: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", f"elasticd_{cluster}_{node}")[:64]


def ruleset(table: str, *, port: int, uid: int, store_address: str | None) -> str:
    """The nft script (pure): reject connections to ``port`` by any other user, to any local
    address (``store_address`` None: this host holds the store) or to ``store_address``."""
    if store_address is None:
        where = "fib daddr type local"
    else:
        family = "ip6" if ipaddress.ip_address(store_address).version == 6 else "ip"
        where = f"{family} daddr {store_address}"
    return (
        f"table inet {table}\n"
        f"delete table inet {table}\n"
        f"table inet {table} {{\n"
        f"  chain output {{\n"
        f"    type filter hook output priority 0; policy accept;\n"
        f"    tcp dport {port} {where} meta skuid != {uid} reject with tcp reset\n"
        f"  }}\n"
        f"}}\n"
    )


def _untrusted(program: str) -> str:
    """Why the daemon (root) must not run ``program``; empty when it is root's alone."""
    try:
        trust.check_program(program)
    except trust.Untrusted as exc:
        return f"not running {exc}"
    return ""


def remove_table(table: str) -> bool:
    """Remove a table that a daemon which died left (``elasticd --clean-up``); whether one
    was there to remove.  Without nft, or not as root, there is none of ours."""
    nft = _nft()
    if nft is None or os.getuid() != 0 or _untrusted(nft):
        return False
    return _delete_table(nft, table)


def _nft() -> str | None:
    return trust.which("nft") or trust.which("nft", path="/usr/sbin:/sbin")


def _delete_table(nft: str, table: str) -> bool:
    """``nft delete table inet TABLE``; whether it was there."""
    try:
        done = subprocess.run(
            [nft, "delete", "table", "inet", table],
            capture_output=True,
            timeout=_NFT_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("could not remove nftables table %s: %s", table, exc)
        return False
    return done.returncode == 0


class StoreFirewall:
    """The rule of one daemon: installed at start, removed at stop."""

    def __init__(self, table: str, nft: str) -> None:
        self.table = table
        self._nft = nft

    @classmethod
    def setup(
        cls,
        setting: bool | str,
        *,
        cluster: str,
        node: str,
        port: int,
        uid: int,
        store_address: str | None,
    ) -> StoreFirewall | None:
        """Install the rule (None when it is off, or 'auto' and not possible here)."""
        if setting is False:
            return None
        nft = _nft()
        problem = (
            "the daemon does not run as root"
            if uid != 0
            else "nft is not installed"
            if nft is None
            else _untrusted(nft)
        )
        if problem or nft is None:  # (no nft is a problem)
            if setting is True:
                raise ConfigError(KEY, f"cannot install the store's nftables rule: {problem}")
            log.warning(
                "store port %d is open to every local user (%s; %s = auto): records are "
                "signed and secrets encrypted, but anyone here can delete them",
                port,
                problem,
                KEY,
            )
            return None
        firewall = cls(table_name(cluster, node), nft)
        if not firewall._run(
            ruleset(firewall.table, port=port, uid=uid, store_address=store_address), setting
        ):
            return None
        log.info(
            "store port %d: only uid %d of this host may connect (nftables table inet %s)",
            port,
            uid,
            firewall.table,
        )
        return firewall

    def _run(self, script: str, setting: bool | str) -> bool:
        try:
            subprocess.run(
                [self._nft, "-f", "-"],
                input=script,
                text=True,
                capture_output=True,
                timeout=_NFT_TIMEOUT,
                check=True,
            )
            return True
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            if setting is True:
                raise ConfigError(KEY, f"nft refused the store's rule: {detail.strip()}") from exc
            log.warning(
                "could not install the store's nftables rule (%s): the store port is open "
                "to every local user",
                detail.strip(),
            )
            return False

    def close(self) -> None:
        _delete_table(self._nft, self.table)

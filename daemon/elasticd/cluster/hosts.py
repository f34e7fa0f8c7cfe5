"""Host discovery: the script that says which nodes may take work, run as root when it is
root's alone, once per interval (``HostDiscovery``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from elasticd import trust
from elasticd.core import discovery
from elasticd.shell import procgroup

log = logging.getLogger(__name__)


class DiscoveryFailed(Exception):
    """A run of the discovery script failed (the message says why)."""


_STDERR_TAIL = 512  # bytes of a failed script's stderr that its error message quotes


class UntrustedScript(DiscoveryFailed):
    """The script (or a directory above it, a link on the way, its interpreter) is not root's
    alone: the daemon would run someone else's code, as root."""


def check_script(script: str) -> None:
    """UntrustedScript unless the script is root's alone (trust.check_program)."""
    try:
        trust.check_program(script)
    except trust.Untrusted as exc:
        raise UntrustedScript(f"refusing to run {exc}") from None


async def run_discovery_script(
    script: str, timeout: float, limit: int = discovery.MAX_OUTPUT
) -> str:
    """What ``script`` printed (no shell, no arguments, stdin closed, in a process group of
    its own that is killed when it ends: nothing it started outlives the run);
    DiscoveryFailed if it cannot be run, exits non-zero, takes longer than ``timeout``,
    prints more than ``limit`` bytes or no UTF-8."""
    try:
        done = await procgroup.run([script], timeout=timeout, limit=limit, tail=_STDERR_TAIL)
    except TimeoutError:  # an OSError too: first
        raise DiscoveryFailed(f"{script} did not finish within {timeout:g} s") from None
    except OSError as exc:
        raise DiscoveryFailed(f"cannot run {script}: {exc.strerror or exc}") from None
    if done.out is None:
        raise DiscoveryFailed(f"{script} printed more than {limit} bytes")
    if done.returncode != 0:
        why = (
            f"exit status {done.returncode}"
            if done.returncode > 0
            else f"killed by signal {-done.returncode}"
        )
        last = done.err.decode(errors="replace").strip().splitlines()[-1:]
        raise DiscoveryFailed(f"{script} failed ({why})" + (f": {last[0]!r}" if last else ""))
    try:
        return done.out.decode()
    except UnicodeDecodeError:
        raise DiscoveryFailed(f"{script} printed something that is not UTF-8") from None


class HostDiscovery:
    """Runs the discovery script once per interval (a timer after each run ends) and tells
    this node whether it is listed, each time that changes.  A failed run is reported to
    ``on_failure`` and changes nothing: the last good list stays in force.  The first run is
    the caller's (``first``), at start-up, where a failure stops the daemon."""

    def __init__(
        self,
        script: str,
        *,
        interval: float,
        timeout: float,
        names: tuple[str, ...],
        on_failure: Callable[[str], None] = lambda why: None,
    ) -> None:
        self.script = script
        self._interval = interval
        self._timeout = timeout
        self._names = names
        self._on_failure = on_failure
        self._listing: discovery.Listing | None = None
        self._failing = ""  # why the runs fail, while they do (logged when it changes)

    async def discover(self) -> discovery.Listing:
        """One run: this node's listing; DiscoveryFailed if the run failed, UntrustedScript
        (before it runs) if the script is no longer root's alone."""
        check_script(self.script)
        output = await run_discovery_script(self.script, self._timeout)
        try:
            hosts = discovery.parse_hosts(output)
        except ValueError as exc:
            raise DiscoveryFailed(f"{self.script} printed {exc}") from None
        return discovery.listing(hosts, self._names)

    async def first(self) -> discovery.Listing:
        """The run at start-up (DiscoveryFailed passes to the caller)."""
        self._listing = await self.discover()
        return self._listing

    async def run(
        self, stop: asyncio.Event, on_listing: Callable[[discovery.Listing], None]
    ) -> None:
        """Until ``stop``: a run per interval; ``on_listing`` when this node's listing changed."""
        while not stop.is_set():
            try:
                async with asyncio.timeout(self._interval):
                    await stop.wait()
                return
            except TimeoutError:
                pass
            try:
                listing = await self.discover()
            except DiscoveryFailed as exc:
                if str(exc) != self._failing:
                    log.warning("host discovery failed, the last list stays in force: %s", exc)
                self._failing = str(exc)
                self._on_failure(str(exc))
                continue
            if self._failing:
                log.info("host discovery works again")
                self._failing = ""
            if listing != self._listing:
                self._listing = listing
                on_listing(listing)

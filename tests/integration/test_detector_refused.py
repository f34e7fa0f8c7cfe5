"""The failure detector's shell on real UDP sockets (three DetectorServices on 127.0.0.1):
a node whose daemon is gone (its port closed, the host up) is lost on its host's word, an
ICMP port unreachable on the socket connected to it, confirmed by a helper that heard the
same; a node that is silent but still bound to its port is left to the silence rule.

``lost_after`` is 20 s here, so a verdict within seconds can only be the refusal's."""

from __future__ import annotations

import asyncio
import time

from hostwide import free_port

from elasticd.cluster.detector import DetectorService
from elasticd.core.detector import DetectorSettings

SETTINGS = DetectorSettings(interval=0.1, suspect_after=0.3, lost_after=20.0)
KEY = b"k" * 32
NAMES = ("a", "b", "c")


class Three:
    """Three detectors watching one group, each in its thread, until the block ends; what
    they told (who, whom, when)."""

    def __init__(self) -> None:
        self.told: list[tuple[str, str, float]] = []
        self.services: dict[str, DetectorService] = {}
        self.stops = {name: asyncio.Event() for name in NAMES}
        self.tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> Three:
        for name in NAMES:
            service = DetectorService(
                name,
                KEY,
                settings=SETTINGS,
                boot=1,
                on_lost=lambda node, silent, me=name: self.told.append(
                    (me, node, time.monotonic())
                ),
            )
            service.bind("127.0.0.1", free_port())
            self.services[name] = service
        endpoints = {name: s.address for name, s in self.services.items()}
        for name, service in self.services.items():
            self.tasks.append(asyncio.create_task(service.run(self.stops[name])))
        await asyncio.sleep(0)  # each run begun: its thread starts
        for service in self.services.values():
            service.learn(endpoints)
            service.watch("job", NAMES)
        # every node heard by the others: only then is its silence judged
        assert await until(
            lambda: all(s.answered == set(NAMES) - {n} for n, s in self.services.items()),
            30.0,
        ), {n: s.answered for n, s in self.services.items()}
        return self

    async def __aexit__(self, *exc: object) -> None:
        for stop in self.stops.values():
            stop.set()
        await asyncio.gather(*self.tasks)
        for service in self.services.values():
            service.close()


async def until(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        await asyncio.sleep(0.02)
    return check()


def test_a_node_whose_port_is_closed_is_lost_on_its_hosts_word():
    async def main():
        async with Three() as three:
            assert three.told == []
            three.stops["c"].set()
            await three.tasks[2]  # its thread ended
            three.services["c"].close()  # nothing listens at its port now
            closed = time.monotonic()
            told = three.told
            assert await until(lambda: {me for me, _, _ in told} == {"a", "b"}, 10.0), told
            assert {node for _, node, _ in told} == {"c"}
            assert all(at - closed < 10.0 < SETTINGS.lost_after for _, _, at in told)

    asyncio.run(main())


def test_a_silent_node_still_bound_to_its_port_is_not_lost_on_that_rule():
    """Its thread stopped (no acks), its port still bound (a frozen process): no refusal,
    so the silence rule (20 s here) decides, not the host's word."""

    async def main():
        async with Three() as three:
            three.stops["c"].set()  # silent from now on; its lobby socket stays bound
            await three.tasks[2]
            assert not await until(lambda: bool(three.told), 3.0), three.told

    asyncio.run(main())

"""Why a node takes no new job (JobService): an operator's drain, the discovery script, the
blacklist.  Each is its own reason: undrain lifts a drain and a blacklisting, never what the
discovery script says; the node's jobs are told to leave once, when the first reason comes."""

from __future__ import annotations

import asyncio

from elasticd.blacklist import Blacklist, BlacklistPolicy
from elasticd.discovery import Listing
from elasticd.model import PartState
from elasticd.placement import Offer, Resources
from elasticd.records import Part
from elasticd.rendezvous import Reason
from elasticd.scheduler import JobService, _Running


class Registry:
    def subscribe(self, callback) -> None:
        pass

    def set_part(self, job_id, part, own):
        return None


class Agent:
    def __init__(self) -> None:
        self.left: list[Reason] = []

    def leave(self, reason: Reason) -> None:
        self.left.append(reason)


def service(**kw) -> tuple[JobService, Agent]:
    jobs = JobService(node="n2", resources=Resources(4, ("0",)), board=None, follower=None,
                      registry=Registry(), agents=None, **kw)
    agent = Agent()
    jobs._running["j-1"] = _Running(agent, Offer("j-1", 1, ()))
    return jobs, agent


def failed(round: int, pid: int) -> Part:
    return Part(node="n2", state=PartState.RUNNING, round=round, workers=(
        {"rank": 0, "local_rank": 0, "node": "n2", "pid": pid, "state": "FAILED", "exit_code": 1},))


def test_discovery_and_the_operator_are_separate_reasons():
    jobs, agent = service()
    assert not jobs.draining and jobs.listed
    jobs.set_listed(Listing(False))
    assert jobs.draining and not jobs.listed and agent.left == [Reason.DRAIN]
    jobs.set_draining(True)
    jobs.set_draining(False)  # the operator's undrain does not override the script
    assert jobs.draining and agent.left == [Reason.DRAIN]
    jobs.set_listed(Listing(True, 2))
    assert not jobs.draining and jobs.resources == Resources(2, ("0",))
    jobs.set_listed(Listing(True))
    assert jobs.resources == Resources(4, ("0",))
    jobs.set_draining(True)
    assert jobs.draining and agent.left == [Reason.DRAIN, Reason.DRAIN]


def test_failures_blacklist_the_node_and_undrain_lifts_it():
    now = [100.0]
    events: list[bool] = []

    async def scenario() -> None:
        jobs, agent = service(blacklist=Blacklist(BlacklistPolicy(2, 60.0, 30.0, 30.0)),
                              on_blacklist=events.append, clock=lambda: now[0],
                              wall_clock=lambda: now[0] + 1000.0)
        jobs.set_draining(True)
        jobs.report("j-1", failed(0, 10))
        jobs.report("j-1", failed(0, 10))  # the same failure again
        assert events == [] and jobs.blacklisted_until == 0.0
        jobs.report("j-1", failed(1, 11))
        assert events == [True] and jobs.blacklisted_until == 1130.0 and jobs.draining
        assert agent.left == [Reason.DRAIN]  # drained already: told to leave once
        jobs.set_draining(False)  # lifts both
        assert events == [True, False] and jobs.blacklisted_until == 0.0 and not jobs.draining
        assert jobs._cooldown is None or jobs._cooldown.cancelled()

    asyncio.run(scenario())


def test_the_node_is_readmitted_when_its_cooldown_ends():
    events: list[bool] = []

    async def scenario() -> None:
        readmitted = asyncio.Event()

        def on_blacklist(on: bool) -> None:
            events.append(on)
            if not on:
                readmitted.set()

        jobs, agent = service(blacklist=Blacklist(BlacklistPolicy(1, 60.0, 0.05, 0.05)),
                              on_blacklist=on_blacklist)
        jobs.report("j-1", failed(0, 10))
        assert jobs.draining and jobs.blacklisted_until > 0 and agent.left == [Reason.DRAIN]
        async with asyncio.timeout(5):
            await readmitted.wait()
        assert not jobs.draining and jobs.blacklisted_until == 0.0

    asyncio.run(scenario())
    assert events == [True, False]


def test_no_blacklist_when_it_is_off():
    async def scenario() -> None:
        jobs, _ = service()
        for pid in range(10):
            jobs.report("j-1", failed(pid, pid))
        assert not jobs.draining

    asyncio.run(scenario())

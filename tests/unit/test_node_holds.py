"""Why a node takes no new job (JobService): an operator's drain, the discovery script, the
blacklist (a user's failures keep only that user's jobs off; several users' blacklist the
node).  Each is its own reason: undrain lifts a drain and a blacklisting, never what the
discovery script says; the node's jobs are told to leave once, when the first reason comes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from elasticd.blacklist import Blacklist, BlacklistPolicy
from elasticd.discovery import Listing
from elasticd.model import PartState
from elasticd.placement import Offer, Resources
from elasticd.records import Part
from elasticd.rendezvous import Reason
from elasticd.scheduler import JobService, _Running


USERS = {"j-1": (1001, "alice"), "j-2": (1002, "bob")}


class Registry:
    def subscribe(self, callback) -> None:
        pass

    def set_part(self, job_id, part, own):
        return None

    def find(self, job_id):
        uid, user = USERS[job_id]
        return SimpleNamespace(id=job_id, spec=SimpleNamespace(id=job_id, uid=uid, user=user))


class Agent:
    def __init__(self, job_id: str) -> None:
        self.left: list[Reason] = []
        self.spec = Registry().find(job_id).spec

    def leave(self, reason: Reason) -> None:
        self.left.append(reason)


def service(**kw) -> tuple[JobService, Agent]:
    jobs, agents = services(**kw)
    return jobs, agents["j-1"]


def services(**kw) -> tuple[JobService, dict[str, Agent]]:
    """A JobService running j-1 (alice's) and j-2 (bob's)."""
    jobs = JobService(node="n2", resources=Resources(4, ("0",)), board=None, follower=None,
                      registry=Registry(), agents=None, **kw)
    agents = {job_id: Agent(job_id) for job_id in USERS}
    for job_id, agent in agents.items():
        jobs._running[job_id] = _Running(agent, Offer(job_id, 1, ()))
    return jobs, agents


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


def test_one_users_failures_keep_their_jobs_off_and_leave_the_others_running():
    now = [100.0]
    events: list[bool] = []

    async def scenario() -> None:
        jobs, agents = services(blacklist=Blacklist(BlacklistPolicy(2, 60.0, 30.0, 30.0)),
                                on_blacklist=events.append, clock=lambda: now[0])
        jobs.report("j-1", failed(0, 10))
        jobs.report("j-1", failed(0, 10))  # the same failure again
        assert agents["j-1"].left == [] and jobs._blacklist.kept_off() == set()
        jobs.report("j-1", failed(1, 11))
        assert agents["j-1"].left == [Reason.DRAIN] and agents["j-2"].left == []  # bob's job stays
        assert jobs._blacklist.kept_off() == {1001} and not jobs.draining and events == []
        assert 1001 in jobs._user_cooldowns
        jobs.set_draining(False)  # an operator's undrain lifts it too
        assert jobs._blacklist.kept_off() == set() and not jobs._user_cooldowns

    asyncio.run(scenario())


def test_failures_of_two_users_blacklist_the_node_and_undrain_lifts_it():
    now = [100.0]
    events: list[bool] = []

    async def scenario() -> None:
        jobs, agents = services(blacklist=Blacklist(BlacklistPolicy(2, 60.0, 30.0, 30.0)),
                                on_blacklist=events.append, clock=lambda: now[0],
                                wall_clock=lambda: now[0] + 1000.0)
        jobs.set_draining(True)
        for pid in (10, 11):
            jobs.report("j-1", failed(pid, pid))
        assert events == [] and jobs.blacklisted_until == 0.0
        jobs.report("j-2", failed(0, 20))
        jobs.report("j-2", failed(1, 21))
        assert events == [True] and jobs.blacklisted_until == 1130.0 and jobs.draining
        assert agents["j-2"].left == [Reason.DRAIN]  # drained already: told to leave once
        jobs.set_draining(False)  # lifts both
        assert events == [True, False] and jobs.blacklisted_until == 0.0 and not jobs.draining
        assert jobs._cooldown is None or jobs._cooldown.cancelled()
        assert jobs._blacklist.kept_off() == set()

    asyncio.run(scenario())


def test_the_node_is_readmitted_when_its_cooldown_ends_and_a_user_when_theirs_does():
    events: list[bool] = []

    async def scenario() -> None:
        readmitted = asyncio.Event()

        def on_blacklist(on: bool) -> None:
            events.append(on)
            if not on:
                readmitted.set()

        jobs, agents = services(blacklist=Blacklist(BlacklistPolicy(1, 60.0, 0.05, 0.05)),
                                on_blacklist=on_blacklist)
        jobs.report("j-1", failed(0, 10))
        assert not jobs.draining and jobs._blacklist.kept_off() == {1001}
        jobs.report("j-2", failed(0, 20))
        assert jobs.draining and jobs.blacklisted_until > 0 and agents["j-2"].left == [Reason.DRAIN]
        async with asyncio.timeout(5):
            await readmitted.wait()
            while jobs._user_cooldowns:  # the users' timers end at the same time
                await asyncio.sleep(0.01)
        assert not jobs.draining and jobs.blacklisted_until == 0.0
        assert jobs._blacklist.kept_off() == set()

    asyncio.run(scenario())
    assert events == [True, False]


def test_no_blacklist_when_it_is_off():
    async def scenario() -> None:
        jobs, agents = services()
        for pid in range(10):
            jobs.report("j-1", failed(pid, pid))
        assert not jobs.draining and agents["j-1"].left == []

    asyncio.run(scenario())

"""A submit's job id is one that no job this node knows has (ids are 24 bits)."""

from types import SimpleNamespace

from elasticd.control import commands
from elasticd.control.commands import Commands


def test_a_new_id_skips_the_ids_of_known_jobs(monkeypatch):
    drawn = iter(["j-aaaaaa", "j-bbbbbb", "j-cccccc"])
    monkeypatch.setattr(commands, "new_job_id", lambda: next(drawn))
    known = {"j-aaaaaa": object(), "j-bbbbbb": object()}
    fake = SimpleNamespace(_registry=SimpleNamespace(find=known.get))
    assert Commands._unused_job_id(fake) == "j-cccccc"


def test_ids_look_like_the_ones_the_docs_and_the_journal_parse():
    assert all(
        len(commands.new_job_id()) == 8 and commands.new_job_id().startswith("j-")
        for _ in range(100)
    )

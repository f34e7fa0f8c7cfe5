"""The [scheduler] section (docs/configuration.md): its keys, the allocator's Policy built from them, every
bad value refused naming its dotted key (nested tables too), and the --priority and
--account bounds of a submit (pure)."""

from __future__ import annotations

import pytest

from elasticd import config
from elasticd.core.allocation import Policy, Quota
from elasticd.core.fairshare import HALF_LIFE
from elasticd.core.quotas import PriorityBounds, account_refusal
from elasticd.errors import ConfigError

GOOD = """
[scheduler]
enabled = false
resize_interval = 5
min_run_time = 20
half_life = 3600
max_priority = 2
priority_users = {alice = 10}
priority_groups = {ml = 20}
shares = {ml = 2, physics = 0.5}

[scheduler.user_quota]
nodes = 2
gpus = 8

[scheduler.account_quota]
slots = 64

[scheduler.users.alice]
nodes = 4

[scheduler.users."bob.smith"]
gpus = 0

[scheduler.accounts.ml]
gpus = 16
nodes = 6
"""


def test_defaults_are_a_shared_clusters():
    scheduler = config.load().scheduler
    assert (
        scheduler.enabled and scheduler.resize_interval == 30.0 and scheduler.half_life == HALF_LIFE
    )
    assert scheduler.max_priority == 0
    assert scheduler.min_run_time == 60.0  # a job is disturbed at most once a minute
    assert scheduler.policy() == Policy(
        resize_interval=30.0, half_life=7 * 86400.0, min_run_time=60.0
    )


def test_the_keys_and_the_policy_they_make(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(GOOD)
    scheduler = config.load(str(path)).scheduler
    assert (scheduler.enabled, scheduler.resize_interval, scheduler.half_life) == (
        False,
        5.0,
        3600.0,
    )
    assert isinstance(scheduler.resize_interval, float)
    policy = scheduler.policy()
    assert policy.user_default == Quota(nodes=2, gpus=8)
    assert policy.account_default == Quota(slots=64)
    # an entry replaces the limits it sets of the default and keeps the others
    assert policy.users == {"alice": Quota(nodes=4, gpus=8), "bob.smith": Quota(nodes=2, gpus=0)}
    assert policy.accounts == {"ml": Quota(nodes=6, gpus=16, slots=64)}
    assert policy.account_shares == {"ml": 2.0, "physics": 0.5}
    assert (policy.resize_interval, policy.half_life, policy.min_run_time) == (5.0, 3600.0, 20.0)


@pytest.mark.parametrize(
    "tables, key, words",
    [
        ({"enabled": "yes"}, "scheduler.enabled", "true or false"),
        ({"resize_interval": -1}, "scheduler.resize_interval", "0 or more"),
        ({"half_life": "7d"}, "scheduler.half_life", "must be a number"),
        ({"max_priority": -1}, "scheduler.max_priority", "must be 0..1000000"),
        ({"max_priority": 1.5}, "scheduler.max_priority", "must be an integer"),
        ({"max_priority": 2_000_000}, "scheduler.max_priority", "must be 0..1000000"),
        (
            {"priority_users": {"alice": "high"}},
            "scheduler.priority_users.alice",
            "must be an integer",
        ),
        ({"priority_users": {"alice": -3}}, "scheduler.priority_users.alice", "must be 0..1000000"),
        ({"priority_groups": {"ml": 10**7}}, "scheduler.priority_groups.ml", "must be 0..1000000"),
        ({"priority_groups": ["ml"]}, "scheduler.priority_groups", "a table of integers"),
        ({"user_quota": {"nodes": -1}}, "scheduler.user_quota.nodes", "0 or more, got -1"),
        (
            {"user_quota": {"cpus": 4}},
            "scheduler.user_quota.cpus",
            "unknown key (known: nodes, gpus, slots)",
        ),
        ({"account_quota": {"gpus": 2.5}}, "scheduler.account_quota.gpus", "must be an integer"),
        ({"account_quota": {"gpus": True}}, "scheduler.account_quota.gpus", "must be an integer"),
        ({"account_quota": 4}, "scheduler.account_quota", "a table of integers"),
        ({"users": {"alice": {"nodes": -2}}}, "scheduler.users.alice.nodes", "0 or more"),
        ({"users": {"alice": {"nodez": 2}}}, "scheduler.users.alice.nodez", "unknown key"),
        ({"users": {"alice": 4}}, "scheduler.users.alice", "a table of integers, got 4"),
        ({"users": {"alice": {"slots": "x"}}}, "scheduler.users.alice.slots", "must be an integer"),
        ({"accounts": {"ml": {"gpus": -8}}}, "scheduler.accounts.ml.gpus", "0 or more"),
        ({"accounts": "ml"}, "scheduler.accounts", "a table of tables of integers"),
        ({"shares": {"ml": 0}}, "scheduler.shares.ml", "greater than 0"),
        ({"shares": {"ml": -1.5}}, "scheduler.shares.ml", "greater than 0"),
        ({"shares": {"ml": float("inf")}}, "scheduler.shares.ml", "greater than 0"),
        ({"shares": {"ml": float("nan")}}, "scheduler.shares.ml", "greater than 0"),
        ({"shares": {"ml": "half"}}, "scheduler.shares.ml", "must be a number"),
        (
            {"bogus": 1},
            "scheduler.bogus",
            "unknown key (known: enabled, resize_interval, min_run_time, half_life",
        ),
    ],
)
def test_bad_values_name_the_dotted_key(tables, key, words):
    with pytest.raises(ConfigError) as info:
        config.from_tables({"scheduler": tables})
    assert info.value.key == key
    assert f"'{key}'" in str(info.value) and words in str(info.value), str(info.value)


def test_check_config_lists_every_nested_problem(tmp_path):
    """Each problem is set aside by its own key, so the next one in the same table is found."""
    path = tmp_path / "c.toml"
    path.write_text(
        "[scheduler.users.alice]\ncpus = 1\nnodes = -2\ngpus = 4\n"
        "[scheduler.shares]\nml = 0\nphysics = 2\n"
    )
    assert [str(p) for p in config.problems(str(path))] == [
        "config key 'scheduler.users.alice.cpus': unknown key (known: nodes, gpus, slots)",
        "config key 'scheduler.users.alice.nodes': must be 0 or more, got -2",
        "config key 'scheduler.shares.ml': must be greater than 0, got 0.0",
    ]


# -- the bounds of a submit ----------------------------------------------------------------

BOUNDS = PriorityBounds(default=2, users={"alice": 10, "carol": 1}, groups={"ml": 20, "ops": 5})


@pytest.mark.parametrize(
    "user, groups, admin, bound",
    [
        ("dave", ["dave"], False, 2),  # the default
        ("alice", ["alice"], False, 10),  # their own entry
        ("alice", ["alice", "ml"], False, 20),  # a group's, higher
        ("carol", ["carol"], False, 2),  # an entry below the default does not lower it
        ("carol", ["carol", "ops", "ml"], False, 20),  # the highest of their groups'
        ("dave", ["dave"], True, None),  # root and the admin group: unbounded
    ],
)
def test_a_users_bound_is_the_highest_that_applies(user, groups, admin, bound):
    assert BOUNDS.of(user, groups, admin) == bound
    scheduler = config.from_tables(
        {
            "scheduler": {
                "max_priority": 2,
                "priority_users": {"alice": 10, "carol": 1},
                "priority_groups": {"ml": 20, "ops": 5},
            }
        }
    ).scheduler
    assert scheduler.priority_bound(user, groups, admin) == bound


def test_a_priority_over_the_bound_is_refused_naming_it_and_its_key():
    assert BOUNDS.refusal(2, "dave", ["dave"], False) is None
    assert BOUNDS.refusal(-500, "dave", ["dave"], False) is None  # lower: always
    assert BOUNDS.refusal(10**6, "dave", ["dave"], True) is None  # admins: any
    said = BOUNDS.refusal(3, "dave", ["dave"], False)
    assert said.startswith(
        "--priority 3 is over 2, the highest dave may ask (scheduler.max_priority = 2)"
    )
    assert "scheduler.priority_users.dave" in said and "scheduler.priority_groups.<group>" in said
    assert "(scheduler.priority_groups.ml = 20)" in BOUNDS.refusal(
        21, "alice", ["alice", "ml"], False
    )
    assert "(scheduler.priority_users.alice = 10)" in BOUNDS.refusal(11, "alice", ["alice"], False)
    assert PriorityBounds().refusal(0, "u", [], False) is None
    assert PriorityBounds().refusal(1, "u", [], False) is not None


def test_an_account_is_a_group_of_the_user_unless_admin():
    assert account_refusal("ml", "alice", ["alice", "ml"], False) is None
    assert account_refusal("physics", "alice", ["physics"], True) is None
    said = account_refusal("physics", "alice", ["alice", "ml"], False)
    assert said == (
        "--account physics: alice may charge jobs only to a group they are in "
        "(alice, ml); root and the admin group may name any account"
    )

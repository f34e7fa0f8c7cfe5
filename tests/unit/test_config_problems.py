"""config.problems (elasticd --check-config): every error load would raise, in load's words."""

from __future__ import annotations

import pytest

from elasticd import config
from elasticd.errors import ConfigError


def messages(path, overrides=None, **kw):
    return [str(problem) for problem in config.problems(str(path), overrides, **kw)]


def load_error(path, overrides=None, **kw) -> str:
    with pytest.raises(ConfigError) as raised:
        config.load(str(path), overrides, **kw)
    return str(raised.value)


def test_a_good_file_has_none(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[node]\nname = "n1"\nslots = 4\n[store]\nendpoint = "h:1"\n')
    assert config.problems(str(path)) == []
    assert config.problems(None) == []


def test_every_error_in_load_order_and_load_words(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        '[node]\nslots = -1\nbogus = 2\ngpus = "many"\n[store]\nbackend = "etcd"\n'
        '[nodes]\nx = 1\n[jobs]\nstop_grace = "soon"\n'
    )
    found = messages(path)
    assert found[0] == load_error(path)  # the first is the one start-up reports
    assert found == [
        "config key 'node.slots': must be 0 or more, got -1",
        found[1],
        "config key 'node.gpus': must be an integer or 'auto', got 'many'",
        "config key 'store.endpoints': must list the etcd members when store.backend is 'etcd'",
        found[4],
        "config key 'jobs.stop_grace': must be a number, got 'soon'",
    ]
    assert found[1].startswith("config key 'node.bogus': unknown key (known: name, address, ")
    assert found[4].startswith("config key 'nodes': unknown section (known: node, cluster, ")


def test_command_line_overrides_are_checked_too(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[node]\nslots = 2\n")
    assert messages(path, {"node.slots": -3}) == [
        "config key 'node.slots': must be 0 or more, got -3"
    ]
    assert messages(path, {"node.slots": 3}, standalone=True) == []


@pytest.mark.parametrize(
    "text, words",
    [
        (None, "cannot read {path}: No such file or directory"),
        ("[node\n", "{path} is not valid TOML: "),
    ],
)
def test_a_file_that_cannot_be_read_is_one_error(tmp_path, text, words):
    path = tmp_path / "c.toml"
    if text is not None:
        path.write_text(text)
    found = messages(path)
    assert found == [load_error(path)]
    assert found[0].startswith("config key '--config': " + words.format(path=path))


def test_a_table_where_a_value_belongs(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("node = 3\n[jobs]\nstop_grace = -1\n")
    assert messages(path) == [
        "config key 'node': must be a table",
        "config key 'jobs.stop_grace': must be 0 or more, got -1.0",
    ]

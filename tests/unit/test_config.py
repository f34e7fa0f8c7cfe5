"""DaemonConfig: TOML + overrides, every bad key named; the shipped default file agrees."""

import os
import tomllib

import pytest

from elasticd import config
from elasticd.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def test_defaults():
    cfg = config.load()
    assert cfg.store.endpoint == "127.0.0.1:29400"
    assert cfg.metrics.port == 9464
    assert cfg.jobs.stop_grace == 10.0
    assert cfg.node.gpus == "auto"
    assert cfg.rendezvous.keep_alive_interval == 1.0 and cfg.rendezvous.keep_alive_max_attempt == 3


def test_toml_file_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        '[node]\nname = "n7"\nslots = 4\nlabels = {rack = "a"}\n[jobs]\nstop_grace = 2\n'
    )
    cfg = config.load(str(path), {"node.slots": 8})
    assert (cfg.node.name, cfg.node.slots, cfg.node.labels) == ("n7", 8, {"rack": "a"})
    assert cfg.jobs.stop_grace == 2.0 and isinstance(cfg.jobs.stop_grace, float)


@pytest.mark.parametrize(
    "tables, key, words",
    [
        ({"node": {"slots": "x"}}, "node.slots", "must be an integer"),
        ({"node": {"slots": True}}, "node.slots", "must be an integer"),
        ({"node": {"slots": -1}}, "node.slots", "0 or more"),
        ({"node": {"gpus": "many"}}, "node.gpus", "an integer or 'auto'"),
        ({"node": {"labels": {"a": 1}}}, "node.labels", "a table of strings"),
        ({"node": {"bogus": 1}}, "node.bogus", "unknown key"),
        ({"nodes": {"name": "x"}}, "nodes", "unknown section"),
        ({"node": 3}, "node", "must be a table"),
        ({"store": {"host": "yes"}}, "store.host", "true, false or 'auto'"),
        ({"store": {"endpoint": "nohost"}}, "store.endpoint", "HOST:PORT"),
        ({"store": {"endpoint": "h:99999"}}, "store.endpoint", "HOST:PORT"),
        ({"metrics": {"port": 70000}}, "metrics.port", "port number"),
        ({"jobs": {"stop_grace": "soon"}}, "jobs.stop_grace", "must be a number"),
        ({"log": {"level": "loud"}}, "log.level", "one of"),
        (
            {"rendezvous": {"keep_alive_interval": 0}},
            "rendezvous.keep_alive_interval",
            "greater than 0",
        ),
        ({"discovery": {"script": "discover.sh"}}, "discovery.script", "absolute path"),
        ({"discovery": {"script": ["/bin/discover"]}}, "discovery.script", "must be a string"),
        ({"discovery": {"interval": 0}}, "discovery.interval", "greater than 0"),
        ({"discovery": {"timeout": -1}}, "discovery.timeout", "greater than 0"),
        ({"blacklist": {"failures": -1}}, "blacklist.failures", "0 or more"),
        ({"blacklist": {"failures": 1.5}}, "blacklist.failures", "must be an integer"),
        ({"blacklist": {"window": 0}}, "blacklist.window", "greater than 0"),
        ({"blacklist": {"cooldown_range": [10]}}, "blacklist.cooldown_range", "[MIN, MAX]"),
        ({"blacklist": {"cooldown_range": [10, 5]}}, "blacklist.cooldown_range", "[MIN, MAX]"),
        ({"blacklist": {"cooldown_range": [0, 5]}}, "blacklist.cooldown_range", "[MIN, MAX]"),
        (
            {"blacklist": {"cooldown_range": [1, "x"]}},
            "blacklist.cooldown_range",
            "a list of numbers",
        ),
        ({"blacklist": {"cooldown_range": 5}}, "blacklist.cooldown_range", "a list of numbers"),
        ({"store": {"backend": "zookeeper"}}, "store.backend", "one of c10d, etcd"),
        ({"store": {"backend": "etcd"}}, "store.endpoints", "must list the etcd members"),
        ({"store": {"endpoints": "h:2379"}}, "store.endpoints", "a list of strings"),
        ({"store": {"endpoints": ["h:2379", "nohost"]}}, "store.endpoints", "'nohost' is not one"),
        ({"store": {"endpoints": ["h:0"]}}, "store.endpoints", "'h:0' is not one"),
        (
            {"store": {"backend": "etcd", "endpoints": ["h:2379"], "cert_file": "/c.pem"}},
            "store.key_file",
            "go together",
        ),
        (
            {"store": {"backend": "etcd", "endpoints": ["h:2379"], "user": "elasticd"}},
            "store.password_file",
            "go together",
        ),
    ],
)
def test_bad_values_name_the_key(tables, key, words):
    with pytest.raises(ConfigError) as info:
        config.from_tables(tables)
    assert info.value.key == key
    assert f"'{key}'" in str(info.value) and words in str(info.value)


def test_discovery_and_blacklist_keys(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        '[discovery]\nscript = "/usr/local/bin/hosts"\ninterval = 2\n'
        "[blacklist]\nfailures = 2\nwindow = 30\ncooldown_range = [2, 4.5]\n"
    )
    cfg = config.load(str(path))
    assert (cfg.discovery.script, cfg.discovery.interval, cfg.discovery.timeout) == (
        "/usr/local/bin/hosts",
        2.0,
        10.0,
    )
    policy = cfg.blacklist.policy
    assert (policy.failures, policy.window, policy.cooldown_min, policy.cooldown_max) == (
        2,
        30.0,
        2.0,
        4.5,
    )
    assert policy.enabled and not config.load().blacklist.policy.enabled  # off by default


def test_etcd_store_keys(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        '[store]\nbackend = "etcd"\nendpoints = ["10.0.0.5:2379", "[fd00::6]:2379"]\n'
        'ca_file = "/etc/elasticd/etcd-ca.pem"\n'
    )
    cfg = config.load(str(path))
    assert cfg.etcd and cfg.store.endpoints == ["10.0.0.5:2379", "[fd00::6]:2379"]
    assert cfg.store_host == "10.0.0.5"  # this node's address is the one on the route to it
    assert not config.load().etcd and not config.load(str(path), standalone=True).etcd


def test_the_etcd_password_is_read_from_an_owner_only_file(tmp_path):
    secret = tmp_path / "etcd.password"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    store = config.from_tables(
        {
            "store": {
                "backend": "etcd",
                "endpoints": ["h:2379"],
                "user": "u",
                "password_file": str(secret),
            }
        }
    ).store
    assert store.password() == "s3cret"
    secret.chmod(0o640)
    with pytest.raises(ConfigError, match="chmod 600") as info:
        store.password()
    assert info.value.key == "store.password_file"
    secret.write_text("\n")
    secret.chmod(0o600)
    with pytest.raises(ConfigError, match="is empty"):
        store.password()
    secret.unlink()
    with pytest.raises(ConfigError, match="cannot read") as info:
        store.password()
    assert info.value.key == "store.password_file"
    assert config.load().store.password() == ""


def test_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        config.load(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[node\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(str(bad))


def test_standalone_user_paths(monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", "/xs")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/xr")
    d = config.standalone_defaults(uid=1000)
    assert d["paths.state_dir"] == "/xs/elasticd" and d["paths.runtime_dir"] == "/xr/elasticd"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert config.standalone_defaults(uid=1000)["paths.runtime_dir"] == "/tmp/elasticd-1000"
    root = config.standalone_defaults(uid=0)
    assert (
        root["paths.state_dir"] == "/var/lib/elasticd"
        and root["paths.runtime_dir"] == "/run/elasticd"
    )


def test_standalone_keeps_explicit_settings(tmp_path):
    cfg = config.load(None, {"paths.state_dir": str(tmp_path)}, standalone=True)
    assert cfg.paths.state_dir == str(tmp_path)
    assert cfg.store.endpoint == "127.0.0.1:0" and cfg.standalone


def test_shipped_default_config_agrees_with_the_daemon():
    """packaging/elasticd.toml sets every key to the daemon's own default and documents it."""
    path = os.path.join(ROOT, "packaging", "elasticd.toml")
    with open(path, "rb") as f:
        shipped = tomllib.load(f)
    flat = {f"{section}.{k}": v for section, table in shipped.items() for k, v in table.items()}
    documented = config.documented_keys()
    assert set(flat) == set(documented)
    for dotted, (default, _doc) in documented.items():
        assert flat[dotted] == default, dotted
    text = open(path).read()
    for dotted, (_default, doc) in documented.items():
        assert doc in text, f"{dotted}: its doc line is missing from {path}"
    config.load(path)  # and it loads


def test_flags_are_declared_with_their_keys():
    from elasticd.app import load_config, parse_args

    found = config.flags()
    assert found["--slots"] == ("node.slots", int, config.documented_keys()["node.slots"][1])
    assert found["--store-host"][1] is bool and found["--gpus"][1] is int
    loaded = load_config(
        parse_args(
            [
                "--standalone",
                "--slots",
                "3",
                "--no-store-host",
                "--store",
                "[::1]:29400",
                "--log-level",
                "debug",
            ]
        )
    )
    assert (loaded.node.slots, loaded.store.host, loaded.store_host, loaded.log.level) == (
        3,
        False,
        "::1",
        "debug",
    )


@pytest.mark.parametrize(
    "argv, allowed",
    [
        ([], False),
        (["--allow-root"], True),
        (["--no-allow-root"], False),
        (["--standalone"], True),  # standalone allows root jobs by default
        (["--standalone", "--no-allow-root"], False),  # unless told otherwise
    ],
)
def test_allow_root_flag(argv, allowed):
    from elasticd.app import load_config, parse_args

    assert config.flags()["--allow-root"][:2] == ("jobs.allow_root", bool)
    assert load_config(parse_args(["--config", os.devnull, *argv])).jobs.allow_root is allowed

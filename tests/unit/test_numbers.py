"""Numbers parse ASCII digits only (wire/numbers.py), and every parser of user- or
wire-supplied text uses it: the control protocol, the CLI's options and environment, the
torchrun flags, endpoints, a discovery script's and nvidia-smi's output, systemd's
variables, a worker's error file and the records of the store and the history.

``int()`` takes ``"1_0"`` and any script's digits (Arabic-Indic ``"\\u0661\\u0660"`` is 10),
``float()`` takes ``"nan"`` and ``"inf"``: a raw submit with nnodes ``"1_0:2_0"`` was 10:20."""

from __future__ import annotations

import argparse
import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticctl import cli, submission, torchrun
from elasticd.cluster.inventory import parse_nvidia_smi
from elasticd.cluster.registry import NodeRecord
from elasticd.core.discovery import parse_hosts
from elasticd.core.membership import Membership
from elasticd.core.records import Outcome
from elasticd.endpoint import split_endpoint
from elasticd.journal import journal_stream
from elasticd.wire import numbers, protocol

ARABIC_10 = "\u0661\u0660"  # ARABIC-INDIC DIGIT ONE, ZERO
FULLWIDTH_3 = "\uff13"
NOT_WHOLE = [
    "1_0",
    ARABIC_10,
    FULLWIDTH_3,
    "\u00b2",  # superscript two: str.isdigit() says yes, int() says no
    " 1",
    "1 ",
    "1\n",
    "+1",
    "0x10",
    "1.0",
    "1e3",
    "",
    "-",
    "9" * 19,
]
NOT_DECIMAL = ["nan", "NaN", "inf", "-inf", "infinity", "1_0.5", ARABIC_10, " 1.5", "1e999", "."]


@pytest.mark.parametrize("text", NOT_WHOLE)
def test_whole_refuses_what_int_would_take(text):
    with pytest.raises(ValueError, match="whole number"):
        numbers.whole(text, signed=True)
    assert not numbers.is_whole(text)


@pytest.mark.parametrize("text", NOT_DECIMAL)
def test_decimal_refuses_what_float_would_take(text):
    with pytest.raises(ValueError, match="number"):
        numbers.decimal(text, signed=True)


@given(st.text(max_size=24))
def test_whole_is_ascii_digits_and_nothing_else(text):
    expected = re.fullmatch(r"-?[0-9]{1,18}", text)
    try:
        value = numbers.whole(text, signed=True)
    except ValueError:
        assert not expected
    else:
        assert expected and value == int(text)


@given(st.integers(min_value=-(10**18) + 1, max_value=10**18 - 1))
def test_every_whole_number_reads_back(value):
    assert numbers.whole(str(value), signed=True) == value
    assert numbers.is_whole(str(value)) is (value >= 0)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_every_finite_float_reads_back(value):
    assert numbers.decimal(repr(value), signed=True) == value


@given(st.text(max_size=24))
def test_decimal_is_finite_ascii_or_refused(text):
    try:
        value = numbers.decimal(text, signed=True)
    except ValueError:
        return
    assert text.isascii() and "_" not in text and text.strip() == text
    assert math.isfinite(value) and value == float(text)


def test_unsigned_refuses_a_sign():
    with pytest.raises(ValueError):
        numbers.whole("-1")
    with pytest.raises(ValueError):
        numbers.decimal("-1.5")


@pytest.mark.parametrize("value", [True, "3", 3.0, None, [3]])
def test_a_record_field_that_must_be_whole_is_an_int(value):
    with pytest.raises(ValueError):
        numbers.json_int(value)


@pytest.mark.parametrize("value", [True, "3", None, math.inf, math.nan])
def test_a_record_field_that_must_be_a_number_is_one(value):
    with pytest.raises(ValueError):
        numbers.json_number(value)


# -- the parsers that use it -----------------------------------------------------------------


@pytest.mark.parametrize(
    "nnodes", ["1_0:2_0", "1_0", f"1:{ARABIC_10}", f"{ARABIC_10}:{ARABIC_10}", " 2", "2:4 "]
)
def test_the_protocol_refuses_such_nnodes(nnodes):
    with pytest.raises(ValueError, match="digits 0-9"):
        protocol.parse_nnodes(nnodes)


@pytest.mark.parametrize("nproc", ["1_0", ARABIC_10, FULLWIDTH_3, " 2", "+2"])
def test_the_protocol_refuses_such_nproc(nproc):
    with pytest.raises(ValueError):
        protocol.parse_nproc(nproc)


def test_the_protocol_still_reads_plain_numbers():
    assert protocol.parse_nnodes("2:4") == (2, 4) and protocol.parse_nnodes(3) == (3, 3)
    assert protocol.parse_nproc("8") == 8 and protocol.parse_nproc("gpu") == "gpu"


@pytest.mark.parametrize("text", ["1_0", ARABIC_10, " 3", "3.0", "nan"])
@pytest.mark.parametrize(
    "parse",
    [
        submission.positive_int,
        submission.non_negative_int,
        submission.integer,
        cli.gpu_index,
        torchrun._whole,
    ],
)
def test_the_cli_whole_number_options_refuse_such_text(parse, text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse(text)


@pytest.mark.parametrize("text", ["1_0", ARABIC_10, "nan", "inf", " 3"])
@pytest.mark.parametrize("parse", [submission.seconds, torchrun._decimal])
def test_the_cli_seconds_options_refuse_such_text(parse, text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse(text)


@pytest.mark.parametrize(
    "line",
    [
        "submit --nnodes 1_0:2_0 x.py",
        f"submit --max-restarts {ARABIC_10} x.py",
        "submit --max-restarts 1_0 x.py",
        "submit --join-timeout 1_0 x.py",
        "submit --monitor-interval nan x.py",
        "submit --master-port 2_9500 x.py",
        f"submit --priority {ARABIC_10} x.py",
    ],
)
def test_such_numbers_on_the_command_line_are_usage_errors(line, capsys):
    assert cli.main(["--socket", "/nonexistent/control.sock", *line.split()]) == 2
    err = capsys.readouterr().err
    assert f"error: argument {line.split()[1]}" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "parse",
    [
        lambda: torchrun.parse_std("1_0", "-r"),
        lambda: torchrun.parse_std(f"0:{ARABIC_10}", "-r"),
        lambda: torchrun.parse_std("3\n", "-r"),
        lambda: torchrun.ranks_filter(f"0,{ARABIC_10}"),
        lambda: torchrun.rdzv_conf("join_timeout=1_0"),
        lambda: torchrun.rdzv_conf("join_timeout=nan"),
    ],
)
def test_torchrun_flags_refuse_such_numbers(parse):
    with pytest.raises(torchrun.TorchrunError):
        parse()


def test_a_pet_switch_reads_digits_only():
    with pytest.raises(torchrun.TorchrunError):
        torchrun.env_switch({"PET_STANDALONE": "1_0"})("standalone", option_strings=["--x"])


def test_elasticctl_timeout_reads_digits_only():
    for value in ("1_0", ARABIC_10, "nan", "inf"):
        with pytest.raises(submission.UsageError):
            cli.reply_timeout({"ELASTICCTL_TIMEOUT": value})
    assert cli.reply_timeout({"ELASTICCTL_TIMEOUT": "2.5"}) == 2.5


@pytest.mark.parametrize("endpoint", [f"h:{ARABIC_10}", "h:2_9400", "h: 29400", "h:+29400"])
def test_an_endpoint_port_is_digits(endpoint):
    with pytest.raises(ValueError):
        split_endpoint(endpoint)


def test_a_discovery_line_slots_are_digits():
    with pytest.raises(ValueError):
        parse_hosts(f"h1:{ARABIC_10}\n")
    with pytest.raises(ValueError):
        parse_hosts("h1:1_0\n")
    assert parse_hosts("h1:10\n") == {"h1": 10}


def test_nvidia_smi_indices_are_digits():
    assert parse_nvidia_smi(f"0\n{ARABIC_10}\n1_0\n\u00b2\n1\n") == ("0", "1")


def test_systemd_variables_are_digits(monkeypatch):
    from elasticd.app import Notifier

    assert journal_stream(f"{ARABIC_10}:5") is None and journal_stream("8:12") == (8, 12)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "1_000_000")
    assert Notifier.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    assert Notifier.watchdog_interval() == 0.5
    monkeypatch.setenv("WATCHDOG_PID", ARABIC_10)
    assert Notifier.watchdog_interval() is None


def test_a_node_record_counts_are_ints():
    doc = NodeRecord.from_json(
        {"info": {"name": "n1", "address": "a", "slots": 2}, "slots_used": 1}
    ).to_json()
    for field, value in (("slots_used", "1"), ("gpus_used", True), ("blacklisted_until", "0")):
        with pytest.raises(ValueError):
            NodeRecord.from_json({**doc, field: value})
    with pytest.raises(ValueError):
        NodeRecord.from_json({**doc, "gpus_out": {ARABIC_10: "lost"}})


def test_an_outcome_and_a_membership_hold_numbers():
    with pytest.raises(ValueError):
        Outcome.from_json({"state": "SUCCEEDED", "ended": "1_0"})
    with pytest.raises(ValueError):
        Membership.from_json([1, False, "12"])


@pytest.mark.parametrize("value", ["1_0", ARABIC_10, " 3", "+3", "3.0"])
def test_the_daemons_number_flags_read_digits_only(value, capsys):
    from elasticd.app import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--slots", value])
    assert "argument --slots: expected a whole number (digits 0-9)" in capsys.readouterr().err
    assert parse_args(["--slots", "3", "--metrics-port", "0"]).__dict__["node.slots"] == 3

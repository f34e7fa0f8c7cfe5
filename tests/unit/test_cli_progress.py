"""submit --wait: the progress line and the exit status (no daemon: documents are fed in)."""

from __future__ import annotations

import io

import pytest

from elasticctl import cli, output


def test_progress_line_on_a_terminal_rewrites_one_line():
    out = io.StringIO()
    progress = output.ProgressLine(out, width=80)
    for line in ("a  PENDING", "a  RUNNING", "a  RUNNING", "a  SUCCEEDED"):
        progress.show(line)
    progress.close()
    assert out.getvalue() == ("\r\x1b[Ka  PENDING\r\x1b[Ka  RUNNING\r\x1b[Ka  SUCCEEDED\n")


def test_progress_line_is_cut_to_the_terminal_width():
    out = io.StringIO()
    progress = output.ProgressLine(out, width=10)
    progress.show("0123456789abcdef")
    assert out.getvalue() == "\r\x1b[K012345678"


def test_progress_line_elsewhere_prints_each_change_once():
    out = io.StringIO()
    progress = output.ProgressLine(out, width=None)
    for line in ("a  PENDING", "a  PENDING", "a  RUNNING", "a  RUNNING", "a  SUCCEEDED"):
        progress.show(line)
    progress.close()
    assert out.getvalue() == "a  PENDING\na  RUNNING\na  SUCCEEDED\n"


def doc(state, **extra):
    return {
        "id": "j-1",
        "state": state,
        "nnodes": "1:1",
        "restarts": 0,
        "max_restarts": 0,
        "round": 0,
        "workers": [],
        **extra,
    }


def args(json=False):
    return cli.parse_args(["--json", "submit", "x.py"] if json else ["submit", "x.py"])


@pytest.mark.parametrize(
    "states,status",
    [
        (["PENDING", "RUNNING", "SUCCEEDED"], 0),
        (["RUNNING", "FAILED"], 1),
        (["PENDING", "CANCELLED"], 130),
    ],
)
def test_exit_status_follows_the_final_state(states, status, capsys):
    assert cli.follow_job(args(), [doc(s) for s in states]) == status
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "job j-1 submitted (waiting for 1 node)"
    assert out[-1].split()[:2] == ["j-1", states[-1]]


def test_failed_job_shows_its_error(capsys):
    failed = doc("FAILED", exit_code=3, error={"message": "ZeroDivisionError", "rank": 0})
    assert cli.follow_job(args(), [doc("RUNNING"), failed]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "error: ZeroDivisionError (rank 0)"


@pytest.mark.parametrize("docs", [[], [doc("RUNNING")]])
def test_stream_without_an_outcome_is_an_error(docs):
    with pytest.raises(cli.ClientError, match="ended the stream"):
        cli.follow_job(args(), docs)


def test_interrupt_leaves_the_job_running_and_says_so(capsys):
    def docs():
        yield doc("RUNNING")
        raise KeyboardInterrupt

    assert cli.follow_job(args(), docs()) == 130
    assert "job j-1 goes on (elasticctl cancel j-1 stops it)" in capsys.readouterr().err


def test_json_prints_every_document(capsys):
    assert cli.follow_job(args(json=True), [doc("RUNNING"), doc("SUCCEEDED")]) == 0
    assert capsys.readouterr().out.count("\n") == 2

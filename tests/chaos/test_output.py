"""A job's name and output are other users' terminal input (docs/security.md, "Text that users and jobs control"): what elasticctl
shows people carries no control character, bidi control or lone surrogate, and no forged
line; --json stays exact."""

from __future__ import annotations

import json
import re

from harness import worker_args

HOSTILE = "evil\x1b]0;pwned\x07\r\nj-000000  fake  SUCCEEDED\x9b31m\u202eabc"
RAW = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def shown(text: str) -> list[str]:
    lines = text.split("\n")
    for line in lines:
        assert not RAW.search(line), repr(line)
    return lines


def test_a_hostile_job_name_and_output_are_shown_escaped(daemon):
    job = daemon.submit_wait("--name", HOSTILE, *worker_args("--print", "1"))
    listed = daemon.ctl_run("list", "--all")
    assert listed.returncode == 0
    rows = shown(listed.stdout.rstrip("\n"))
    assert len(rows) == 2 and "\\x1b]0;pwned\\x07\\r\\nj-000000" in rows[1]  # no forged row
    assert shown(daemon.ctl_run("status", job["id"]).stdout)
    assert [d["name"] for d in daemon.ctl("list", "--all")] == [HOSTILE]  # --json: exact


def test_terminal_escapes_in_a_workers_output_are_shown_escaped(daemon, shared_tmp):
    script = shared_tmp / "loud.py"
    script.write_text(
        "import sys\nprint('a\\x1b[2J\\x1b]0;x\\x07b\\rc')\nsys.stderr.write('\\u202eevil\\n')\n"
    )
    job = daemon.submit_wait(str(script))
    text = daemon.ctl_run("logs", job["id"]).stdout
    lines = shown(text.rstrip("\n"))
    assert "[rank 0] a\\x1b[2J\\x1b]0;x\\x07b\\rc" in lines
    assert "[rank 0 err] \\u202eevil" in lines
    docs = [
        json.loads(line) for line in daemon.ctl_run("--json", "logs", job["id"]).stdout.splitlines()
    ]
    assert {"a\x1b[2J\x1b]0;x\x07b\rc", "\u202eevil"} <= {d["text"] for d in docs}

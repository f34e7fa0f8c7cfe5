"""A job that failed without torch's ``@record`` has the end of its stderr as its root cause
(docs/concepts.md, "What a worker gets"): `status` used to say only "exited with code 1"."""

from __future__ import annotations

from pathlib import Path

import pytest

RAISES = """\
import sys
print("about to fail", file=sys.stderr, flush=True)
def step():
    raise RuntimeError("boom")
try:
    step()
except RuntimeError as exc:
    raise ValueError("while handling boom") from exc
"""

# more than the 8 KiB the daemon keeps of a stream's end: the first line kept is cut
GIVES_UP = """\
import sys
for i in range(2000):
    print(f"Traceback (most recent call last): line {i} is not a traceback", file=sys.stderr)
print("giving up: \\x1b[31mthe disk is full\\x07", file=sys.stderr)
print("   ", file=sys.stderr)
sys.exit(3)
"""

SILENT = "import sys\nprint('stdout only')\nsys.exit(3)\n"


@pytest.mark.parametrize(
    "name, text, code, message",
    [
        ("raises.py", RAISES, 1, "ValueError: while handling boom"),
        ("gives_up.py", GIVES_UP, 3, "giving up: \x1b[31mthe disk is full\x07"),
        ("silent.py", SILENT, 3, "exited with code 3"),
    ],
)
def test_the_root_cause_of_a_failure_without_an_error_file(
    daemon, shared_tmp: Path, name, text, code, message
):
    (shared_tmp / name).write_text(text)
    job = daemon.ctl(
        "submit", "--wait", "--workdir", str(shared_tmp), str(shared_tmp / name), expect=1
    )[-1]
    assert job["state"] == "FAILED"
    status = daemon.ctl("status", job["id"])
    assert status["error"]["message"] == message and status["error"]["exit_code"] == code, status
    assert status["error"]["rank"] == 0
    shown = daemon.ctl_run("status", job["id"]).stdout  # escaped for the terminal
    assert "\x1b" not in shown and "\x07" not in shown
    assert message.replace("\x1b", "\\x1b").replace("\x07", "\\x07") in shown, shown
    # another user sees that it failed, and no text of the job's (docs/security.md, "What others see of a job")
    seen = daemon.ctl("status", job["id"], user="nobody")
    assert seen["error"]["exit_code"] == code and seen["error"]["message"] == "", seen
    assert "boom" not in str(seen) and "disk is full" not in str(seen), seen

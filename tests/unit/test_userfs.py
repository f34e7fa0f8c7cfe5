"""shell/userfs.py on this host's kernel: a thread with a user's file system rights is
refused what the user would be, whatever path leads there; the other threads, and the same
thread after, keep root's."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import needs_root

from elasticd.shell.userfs import rights_of, with_rights_of

NOBODY = pwd.getpwnam("nobody")


@pytest.fixture
def places() -> Iterator[dict[str, Path]]:
    tmp_path = Path(tempfile.mkdtemp(prefix="elasticd-test-userfs-"))  # nobody reaches it
    tmp_path.chmod(0o755)
    root_only = tmp_path / "root-only"
    root_only.mkdir(mode=0o755)
    secret = root_only / "secret"
    secret.write_text("root's")
    secret.chmod(0o600)
    users = tmp_path / "users"
    users.mkdir(mode=0o700)
    os.chown(users, NOBODY.pw_uid, NOBODY.pw_gid)
    (users / "link").symlink_to(root_only)  # as a job would plant it
    yield {"root_only": root_only, "secret": secret, "users": users}
    shutil.rmtree(tmp_path)


@needs_root
def test_through_a_users_link_root_only_places_are_refused_then_root_again(places):
    link, groups = places["users"] / "link", os.getgroups()
    with rights_of(NOBODY.pw_uid, NOBODY.pw_gid):
        with pytest.raises(PermissionError):
            (link / "planted").write_bytes(b"x")
        with pytest.raises(PermissionError):
            (link / "secret").read_text()
        mine = places["users"] / "mine"
        mine.write_bytes(b"y")  # the user's own place: allowed, and the file is theirs
        assert os.getgroups() == []
    assert mine.stat().st_uid == NOBODY.pw_uid
    assert not (places["root_only"] / "planted").exists()
    assert (link / "secret").read_text() == "root's"  # root's rights again
    assert os.getgroups() == groups


@needs_root
def test_only_the_calling_thread_has_the_users_rights(places):
    inside, outside = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def as_user() -> None:
        with rights_of(NOBODY.pw_uid, NOBODY.pw_gid):
            inside.set()
            outside.wait(10)
            try:
                places["secret"].read_text()
                seen["user"] = "read"
            except PermissionError:
                seen["user"] = "refused"

    thread = threading.Thread(target=as_user)
    thread.start()
    assert inside.wait(10)
    seen["root"] = places["secret"].read_text()  # this thread: root's, meanwhile
    outside.set()
    thread.join(10)
    assert seen == {"user": "refused", "root": "root's"}


@needs_root
def test_a_call_made_with_a_users_rights_in_a_worker_thread(places):
    read = with_rights_of(NOBODY.pw_uid, NOBODY.pw_gid, Path.read_text)
    with pytest.raises(PermissionError):
        read(places["users"] / "link" / "secret")
    assert read.__name__ == "read_text"


@needs_root
def test_a_root_jobs_calls_keep_roots_rights(places):
    with rights_of(0, 0):
        assert places["secret"].read_text() == "root's"

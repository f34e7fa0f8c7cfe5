"""The ACL that gives a job's files to its user and the admin group (docs/security.md, "The files of a job on disk"), as the
kernel reads it; and what is left without ACLs.  Who can open what is tested with real users
in tests/chaos/test_job_files.py."""

from __future__ import annotations

import logging
import os
import stat
import struct
import subprocess
from pathlib import Path

import pytest

from elasticd.shell.fileaccess import XATTR, FileAccess, Readers, acl_value, restrict_earlier

U = 0xFFFFFFFF


def entries(value: bytes) -> list[tuple[int, int, int]]:
    assert struct.unpack_from("<I", value) == (2,)
    return [struct.unpack_from("<HHI", value, offset) for offset in range(4, len(value), 8)]


def test_a_files_acl_reads_for_the_user_and_the_admin_group_only():
    assert entries(acl_value(Readers(1001, 990), directory=False)) == [
        (0x01, 6, U),
        (0x02, 4, 1001),
        (0x04, 0, U),
        (0x08, 4, 990),
        (0x10, 4, U),
        (0x20, 0, U),
    ]


def test_a_directorys_acl_lets_them_search_it():
    assert entries(acl_value(Readers(1001, None), directory=True)) == [
        (0x01, 7, U),
        (0x02, 5, 1001),
        (0x04, 0, U),
        (0x10, 5, U),
        (0x20, 0, U),
    ]


def test_roots_jobs_need_no_named_user():
    assert [e[0] for e in entries(acl_value(Readers(0, None), directory=False))] == [
        0x01,
        0x04,
        0x10,
        0x20,
    ]


@pytest.mark.skipif(os.getuid() != 0, reason="ACLs on files of root's")
def test_the_kernel_takes_them_and_shows_the_mask_as_the_group_bits(tmp_path):
    access, readers = FileAccess(), Readers(65534, 0)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        access.grant_file(fd, readers)
    finally:
        os.close(fd)
    access.grant_dir(str(tmp_path), readers)
    assert os.getxattr(tmp_path / "f", XATTR) == acl_value(readers, directory=False)
    assert stat.S_IMODE(os.stat(tmp_path / "f").st_mode) == 0o640  # group bits: the mask
    assert stat.S_IMODE(os.stat(tmp_path).st_mode) == 0o750
    assert os.getxattr(tmp_path, XATTR) == acl_value(readers, directory=True)


def test_a_daemon_that_is_not_root_has_no_other_readers(monkeypatch):
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    assert FileAccess("elasticd-admin").readers(1000) is None


@pytest.fixture
def no_acl_fs(tmp_path: Path):
    """A ramfs: a file system that takes no extended attribute at all."""
    if os.getuid() != 0:
        pytest.skip("mounting needs root")
    mount = tmp_path / "ramfs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "ramfs", "-o", "mode=755", "ramfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_without_acls_files_stay_roots_and_directories_cannot_be_listed(no_acl_fs, caplog):
    access, readers = FileAccess(), Readers(65534, None)
    directory = no_acl_fs / "job"
    directory.mkdir(mode=0o700)
    with caplog.at_level(logging.WARNING, logger="elasticd.shell.fileaccess"):
        access.grant_dir(str(directory), readers)
        for name in ("a", "b"):
            fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT, 0o600)
            access.grant_file(fd, readers)
            os.close(fd)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o711
    assert {stat.S_IMODE((directory / n).stat().st_mode) for n in "ab"} == {0o600}
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "takes no POSIX ACL" in said[0] and "elasticctl logs" in said[0]


def test_files_an_earlier_version_left_to_the_jobs_group_become_the_owners_alone(tmp_path):
    """Before the ACLs a job's files were 0640 root:<the user's group>; at start they are
    made 0600, and nothing else is touched: files with an ACL, links, FIFOs, other folders."""
    attempt = tmp_path / "j-1" / "attempt_0"
    attempt.mkdir(parents=True)
    for name, mode in (
        ("rank_0.out", 0o640),
        ("rank_0.error.json", 0o664),
        ("rank_0.out.rotated", 0o644),
        ("rank_1.out", 0o600),
    ):
        (attempt / name).write_text("x")
        (attempt / name).chmod(mode)
    outside = tmp_path / "outside"
    outside.write_text("x")
    outside.chmod(0o644)
    (attempt / "link").symlink_to(outside)
    os.mkfifo(attempt / "fifo", 0o644)
    other = tmp_path / "j-1" / "notes"
    other.mkdir()
    (other / "n").write_text("x")
    (other / "n").chmod(0o644)
    acl = attempt / "rank_2.out"
    fd = os.open(acl, os.O_WRONLY | os.O_CREAT, 0o600)
    FileAccess().grant_file(fd, Readers(65534, None))
    os.close(fd)

    assert restrict_earlier(str(tmp_path)) == 3
    modes = {
        p.name: stat.S_IMODE(p.lstat().st_mode) for p in attempt.iterdir() if not p.is_symlink()
    }
    assert modes == {
        "rank_0.out": 0o600,
        "rank_0.error.json": 0o600,
        "rank_0.out.rotated": 0o600,
        "rank_1.out": 0o600,
        "fifo": 0o644,
        "rank_2.out": 0o640,
    }
    assert (
        stat.S_IMODE(outside.stat().st_mode) == 0o644
        and stat.S_IMODE((other / "n").stat().st_mode) == 0o644
    )
    assert restrict_earlier(str(tmp_path)) == 0
    assert restrict_earlier(str(tmp_path / "missing")) == 0


def test_another_refusal_is_said_once_for_its_own_reason(caplog):
    access = FileAccess()
    with caplog.at_level(logging.WARNING, logger="elasticd.shell.fileaccess"):
        for _ in range(2):
            access.grant_file(-1, Readers(65534, None))  # no such fd
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "could not be given its ACL (" in said[0]

"""What runs as root is root's (docs/security.md, "Between daemons, and what runs as root"): trust.check_program on real files, owned
by root or by `nobody`, with modes, symlinks and #! interpreters that someone else could
change.  The tests run as root (as the project's tests do)."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from elasticd import trust

NOBODY = pwd.getpwnam("nobody").pw_uid
ROOT = frozenset({0})

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root (chown to nobody)")


def program(path: Path, text: str = "#!/bin/sh\necho n1\n", mode: int = 0o755) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def refused(path: Path | str, allowed: frozenset[int] = ROOT) -> str:
    with pytest.raises(trust.Untrusted) as info:
        trust.check_program(str(path), allowed)
    return str(info.value)


@pytest.fixture
def root_dir(tmp_path: Path) -> Path:
    """A directory only root can write (pytest's tmp_path is under /tmp, sticky, root's)."""
    tmp_path.chmod(0o755)
    return tmp_path


def test_a_program_of_roots_alone_passes(root_dir):
    trust.check_program(str(program(root_dir / "hosts.sh")), ROOT)
    trust.check_program("/bin/sh", ROOT)  # a link (/bin -> usr/bin, sh -> dash)
    trust.check_program("/usr/bin/env", ROOT)


def test_a_program_that_nobody_owns_in_a_directory_nobody_owns(root_dir):
    """Row 0e as filed: the script and its directory are nobody's."""
    home = root_dir / "nobodys"
    home.mkdir()
    script = program(home / "discover")
    os.chown(home, NOBODY, -1)
    os.chown(script, NOBODY, -1)
    assert f"{home} belongs to nobody (uid {NOBODY})" in refused(script)
    os.chown(home, 0, -1)
    assert f"{script} belongs to nobody" in refused(script)


@pytest.mark.parametrize(
    "mode, words",
    [(0o775, "writable by its group"), (0o757, "writable by everyone"), (0o1777, None)],
)  # sticky and root's: as /tmp
def test_a_directory_above_it_that_others_can_write(root_dir, mode, words):
    above = root_dir / "above"
    (above / "below").mkdir(parents=True)
    script = program(above / "below" / "discover")
    above.chmod(mode)
    if words is None:
        trust.check_program(str(script), ROOT)
    else:
        assert f"{above} is {words}" in refused(script)


def test_the_file_itself_writable_by_others(root_dir):
    assert "is writable by its group" in refused(program(root_dir / "d", mode=0o775))
    assert "is writable by everyone" in refused(program(root_dir / "d", mode=0o757))


def test_a_sticky_directory_does_not_excuse_what_is_not_roots_inside_it(root_dir):
    shared = root_dir / "shared"
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)
    script = program(shared / "discover")
    os.chown(script, NOBODY, -1)
    assert "belongs to nobody" in refused(script)


def test_symlinks_are_followed_and_each_step_checked(root_dir):
    loose = root_dir / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    target = program(loose / "real")
    link = root_dir / "link"
    link.symlink_to(target)
    assert f"{loose} is writable by everyone" in refused(link)  # the link leads there

    target = program(root_dir / "real")
    os.chown(loose, NOBODY, -1)
    loose.chmod(0o755)
    hop = loose / "hop"
    hop.symlink_to(target)
    os.lchown(hop, NOBODY, -1)
    link.unlink()
    link.symlink_to("loose/hop")  # relative: through nobody's directory to root's file
    assert f"{loose} belongs to nobody" in refused(link)

    os.chown(loose, 0, -1)
    assert f"{hop} belongs to nobody" in refused(link)  # nobody's own link
    os.lchown(hop, 0, -1)
    trust.check_program(str(link), ROOT)


def test_a_symlink_loop_and_a_missing_file_are_refused(root_dir):
    (root_dir / "a").symlink_to("b")
    (root_dir / "b").symlink_to("a")
    assert "more than 40 symlinks" in refused(root_dir / "a")
    assert "No such file" in refused(root_dir / "missing")
    assert "not an absolute path" in refused("bin/sh")


def test_the_interpreter_of_a_script_must_be_roots_too(root_dir):
    loose = root_dir / "loose"
    loose.mkdir()
    interpreter = loose / "sh"
    interpreter.symlink_to("/bin/sh")
    os.chown(loose, NOBODY, -1)
    script = program(root_dir / "discover", f"#!{interpreter} -e\necho n1\n")
    assert f"{loose} belongs to nobody" in refused(script)
    script = program(root_dir / "discover", "#!sh\necho n1\n")
    assert "is not an absolute path" in refused(script)


def test_env_finds_the_interpreter_on_path_and_that_is_checked(root_dir, monkeypatch):
    loose = root_dir / "bin"
    loose.mkdir()
    loose.chmod(0o777)
    program(loose / "mypython", "#!/bin/sh\necho n1\n")
    monkeypatch.setenv("PATH", f"{loose}:/usr/bin:/bin")
    for line in (
        "#!/usr/bin/env mypython",
        "#!/usr/bin/env -S mypython -u",
        "#!/usr/bin/env A=1 mypython",
    ):
        script = program(root_dir / "discover", f"{line}\nprint('n1')\n")
        assert f"{loose} is writable by everyone" in refused(script)
    loose.chmod(0o755)
    trust.check_program(str(script), ROOT)
    script = program(root_dir / "discover", "#!/usr/bin/env nosuchprogram\n")
    assert "'nosuchprogram' is not on PATH" in refused(script)
    script = program(root_dir / "discover", "#!/usr/bin/env -i\n")
    assert "cannot tell which program" in refused(script)


def test_an_interpreter_that_is_a_script_is_followed(root_dir):
    inner = program(root_dir / "inner", '#!/bin/sh\nexec sh "$@"\n')
    outer = program(root_dir / "outer", f"#!{inner}\necho n1\n")
    trust.check_program(str(outer), ROOT)
    os.chown(inner, NOBODY, -1)
    assert f"{inner} belongs to nobody" in refused(outer)
    looping = program(root_dir / "looping", f"#!{root_dir / 'looping'}\n")
    assert "too many nested" in refused(looping)


def test_the_daemons_own_user_may_own_it(root_dir):
    script = program(root_dir / "discover")
    os.chown(script, NOBODY, -1)
    trust.check_program(str(script), frozenset({0, NOBODY}))  # a daemon run by nobody
    assert trust.owners(NOBODY) == {0, NOBODY}


def test_which_skips_relative_path_entries(root_dir, monkeypatch):
    program(root_dir / "tool")
    monkeypatch.chdir(root_dir)
    assert trust.which("tool", path=".:") is None
    assert trust.which("tool", path=f".:{root_dir}") == str(root_dir / "tool")

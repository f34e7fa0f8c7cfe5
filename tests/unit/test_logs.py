"""Whole lines out of chunks from several sources; a reader that follows the files."""

from elasticd.shell.logs import MAX_PARTIAL, READ_CHUNK, LineSplitter, LogReader, log_files

A = (0, 0, "out")
B = (0, 1, "err")


def texts(lines):
    return [(line["rank"], line["stream"], line["text"]) for line in lines]


def test_lines_across_chunks_and_sources():
    s = LineSplitter()
    assert texts(s.feed(A, b"he")) == []
    assert texts(s.feed(B, b"x\r\ny")) == [(1, "err", "x")]
    assert texts(s.feed(A, b"llo\nwor")) == [(0, "out", "hello")]
    assert texts(s.flush()) == [(0, "out", "wor"), (1, "err", "y")]
    assert s.seen == {A: 9, B: 4}


def test_a_long_line_without_newline_is_cut():
    s = LineSplitter()
    out = s.feed(A, b"x" * (MAX_PARTIAL + 1))
    assert len(out) == 1 and len(out[0]["text"]) == MAX_PARTIAL + 1


def test_log_files_in_order(tmp_path):
    for attempt, rank, stream in [(1, 0, "out"), (0, 1, "err"), (0, 0, "out"), (0, 10, "out")]:
        d = tmp_path / "j" / f"attempt_{attempt}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"rank_{rank}.{stream}").write_text("x")
    (tmp_path / "j" / "attempt_0" / "rank_0.error.json").write_text("{}")
    (tmp_path / "j" / "junk").mkdir()
    assert [(a, r, s) for a, r, s, _ in log_files(str(tmp_path), "j")] == [
        (0, 0, "out"),
        (0, 1, "err"),
        (0, 10, "out"),
        (1, 0, "out"),
    ]
    assert log_files(str(tmp_path), "missing") == []


def test_the_reader_reads_on_from_where_it_left_and_takes_turns(tmp_path):
    d = tmp_path / "j" / "attempt_0"
    d.mkdir(parents=True)
    big = d / "rank_0.out"
    big.write_bytes(b"a\n" * READ_CHUNK)  # two chunks
    (d / "rank_1.out").write_bytes(b"b1\nb2")
    reader = LogReader(str(tmp_path), "j", "n1")
    batches = [texts(lines) for lines in reader.new_lines()]
    assert [b[0][:2] for b in batches] == [(0, "out"), (1, "out"), (0, "out")]  # in turn
    assert sum(len(b) for b in batches) == READ_CHUNK + 1
    assert list(reader.new_lines()) == []  # nothing new
    with open(d / "rank_1.out", "ab") as f:
        f.write(b"3\nb4\n")
    assert [texts(lines) for lines in reader.new_lines()] == [[(1, "out", "b23"), (1, "out", "b4")]]


def test_a_snapshot_stops_at_what_the_files_held(tmp_path):
    d = tmp_path / "j" / "attempt_0"
    d.mkdir(parents=True)
    (d / "rank_0.out").write_bytes(b"one\n")
    reader = LogReader(str(tmp_path), "j", "n1", wanted=lambda attempt, rank: rank == 0)
    lines = reader.new_lines(snapshot=True)
    assert texts(next(lines)) == [(0, "out", "one")]
    with open(d / "rank_0.out", "ab") as f:
        f.write(b"two\n")
    assert list(lines) == []


# -- rotation (docs/concepts.md) ----------------------------------------------------------------

import os  # noqa: E402

import pytest  # noqa: E402

from elasticd.shell.logs import OutputLimit, Rotations, move_stream, read_rotations, rotate  # noqa: E402
from elasticd.shell.workers import OutputFile  # noqa: E402


@pytest.mark.parametrize(
    "size, data, want",
    [
        (0, b"abc\n", 4),  # fits
        (4, b"ab\ncd\n", 6),  # fills the file exactly: no rotation yet
        (6, b"ab\ncd\nef\n", 3),  # up to the last newline that fits
        (8, b"a\nb\n", 2),  # a whole line fits in the 2 bytes left
        (8, b"abc\n", 0),  # no whole line fits: rotate first
        (0, b"x" * 25, 10),  # a line longer than a file: cut where the file is full
        (12, b"a\n", 0),  # already past the limit (it was lowered): rotate
    ],
)
def test_where_a_chunk_is_cut(size, data, want):
    assert OutputLimit(max_bytes=10, backups=2).cut(size, data) == want


def test_no_limit_never_cuts():
    assert OutputLimit(0, 3).cut(10**12, b"x" * 100) == 100


def test_rotate_shifts_the_files_and_deletes_past_backups(tmp_path):
    path = str(tmp_path / "rank_0.out")
    done = Rotations()
    for generation in range(5):
        with open(path, "wb") as f:
            f.write(b"g%d\n" % generation)
        done = rotate(path, 2, done)
    assert not os.path.exists(path)  # the caller makes the new one
    assert [open(f"{path}.{k}", "rb").read() for k in (1, 2)] == [b"g4\n", b"g3\n"]
    assert not os.path.exists(f"{path}.3")
    assert done == read_rotations(path) == Rotations(count=5, dropped=9)  # g0..g2, 3 bytes each


def test_rotate_without_backups_deletes_and_a_missing_file_needs_no_rotation(tmp_path):
    path = str(tmp_path / "rank_0.err")
    with open(path, "wb") as f:
        f.write(b"12345")
    assert rotate(path, 0, Rotations()) == Rotations(1, 5)
    assert rotate(path, 0, Rotations(1, 5)) == Rotations(1, 5)  # the new file was never made


def test_rotations_file_damaged_reads_as_none(tmp_path):
    path = str(tmp_path / "rank_0.out")
    open(path + ".rotated", "w").write("many\n")
    assert read_rotations(path) == Rotations()


def writer(path, max_bytes, backups, dropped=None):
    def create(p):
        return os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)

    return OutputFile(
        str(path),
        create,
        lambda n, why: dropped.append((n, why)) if dropped is not None else None,
        OutputLimit(max_bytes, backups),
    )


def chain(path, backups):
    """The kept files of a stream, oldest first."""
    names = [f"{path}.{k}" for k in range(backups, 0, -1)] + [str(path)]
    return [open(n, "rb").read() for n in names if os.path.exists(n)]


def test_an_output_file_never_grows_past_its_limit_and_keeps_lines_whole(tmp_path):
    path = tmp_path / "rank_0.out"
    out = writer(path, 100, 2)
    stream = b"".join(b"line %04d\n" % i for i in range(1000))  # 10 bytes a line
    for start in range(0, len(stream), 37):  # chunks that end mid-line
        out.write(stream[start : start + 37])
    out.close()
    kept = chain(path, 2)
    assert len(kept) == 3 and all(len(f) <= 100 for f in kept)
    assert all(f.endswith(b"\n") for f in kept[:-1])  # rotated at a line's end
    assert stream.endswith(b"".join(kept))  # the newest output, in order, nothing in between lost
    rotations = read_rotations(str(path))
    assert rotations.dropped + sum(map(len, kept)) == len(stream)


def test_a_rotation_that_fails_drops_output_and_says_so(tmp_path):
    path = tmp_path / "rank_0.out"
    dropped = []
    out = writer(path, 200, 1, dropped)
    out.write(b"x" * 199 + b"\n")  # full
    os.mkdir(str(path) + ".rotated")  # its count cannot be written: no rotation
    out.write(b"abc\n")
    assert dropped == [(4, "cannot rotate: Is a directory")]
    os.rmdir(str(path) + ".rotated")
    out.write(b"xyz\n")
    out.close()
    assert chain(path, 1) == [
        b"x" * 199 + b"\n",
        b"\n[elasticd: 4 bytes of output dropped here: cannot rotate: Is a directory]\nxyz\n",
    ]


def test_move_stream_takes_the_rotated_files_along(tmp_path):
    old, new = tmp_path / "slot_0-1.out", tmp_path / "rank_3.out"
    out = writer(old, 10, 2)
    out.write(b"a" * 9 + b"\n" + b"b" * 9 + b"\n" + b"c\n")
    move_stream(str(old), str(new))
    out.path = str(new)
    out.write(b"d" * 9 + b"\n")
    out.close()
    assert chain(new, 2) == [b"b" * 9 + b"\n", b"c\n", b"d" * 9 + b"\n"]
    assert read_rotations(str(new)).count == 3 and not list(tmp_path.glob("slot_*"))


def read_all(reader, snapshot=False):
    return [line["text"] for lines in reader.new_lines(snapshot=snapshot) for line in lines]


def test_a_follower_keeps_its_place_across_rotations(tmp_path):
    d = tmp_path / "j" / "attempt_0"
    d.mkdir(parents=True)
    out = writer(d / "rank_0.out", 100, 3)
    reader = LogReader(str(tmp_path), "j", "n1")
    seen = []
    for i in range(60):  # 10 bytes a line: a rotation every 10 lines, read every 7
        out.write(b"line %04d\n" % i)
        if i % 7 == 6:
            seen += read_all(reader)
    seen += read_all(reader)
    assert seen == [f"line {i:04d}" for i in range(60)]  # nothing lost, nothing twice


def test_a_follower_left_behind_is_told_what_it_missed(tmp_path):
    d = tmp_path / "j" / "attempt_0"
    d.mkdir(parents=True)
    out = writer(d / "rank_0.out", 100, 1)
    reader = LogReader(str(tmp_path), "j", "n1")
    out.write(b"line 0000\nline 0001\nline 00")
    assert read_all(reader) == ["line 0000", "line 0001"]
    for i in range(2, 50):  # four rotations while it does not read: its file is gone
        out.write((b"line %04d\n" % i)[(7 if i == 2 else 0) :])
    seen = read_all(reader)
    assert seen[0] == "line 00"  # its partial line, then what happened
    assert "rotated away here before it could be read" in seen[1]
    assert seen[2:] == [f"line {i:04d}" for i in range(30, 50)]  # the two kept files


def test_history_shows_the_kept_files_oldest_first_after_a_note(tmp_path):
    d = tmp_path / "j" / "attempt_0"
    d.mkdir(parents=True)
    out = writer(d / "rank_0.out", 100, 2)
    for i in range(45):
        out.write(b"line %04d\n" % i)
    out.close()
    seen = read_all(LogReader(str(tmp_path), "j", "n1"), snapshot=True)
    assert (
        seen[0]
        == "[elasticd: 200 bytes of earlier output were rotated away (output.max_bytes, output.backups)]"
    )
    assert seen[1:] == [
        f"line {i:04d}" for i in range(20, 45)
    ]  # 10 lines a file: 2 rotated, 1 live


def test_a_snapshot_read_while_the_file_rotates_ends_where_it_began(tmp_path):
    d = tmp_path / "j" / "attempt_0"
    d.mkdir(parents=True)
    out = writer(d / "rank_0.out", READ_CHUNK * 2, 2)
    first = b"a" * 99 + b"\n"
    for _ in range(READ_CHUNK * 3 // 100):  # a rotated file and a live one, chunks to read
        out.write(first)
    reader = LogReader(str(tmp_path), "j", "n1").new_lines(snapshot=True)
    batches = [next(reader)]
    for _ in range(700):  # meanwhile: the live file is rotated (the one being read is kept)
        out.write(b"b" * 99 + b"\n")
    batches += list(reader)
    texts_seen = [line["text"] for batch in batches for line in batch]
    assert texts_seen == ["a" * 99] * (READ_CHUNK * 3 // 100)  # what was there, no "b"


def test_log_files_lists_a_stream_whose_live_file_is_missing(tmp_path):
    d = tmp_path / "j" / "attempt_0"
    d.mkdir(parents=True)
    (d / "rank_0.out.1").write_text("x\n")
    (d / "rank_0.out.rotated").write_text("1 0\n")
    assert log_files(str(tmp_path), "j") == [(0, 0, "out", str(d / "rank_0.out"))]
    assert read_all(LogReader(str(tmp_path), "j", "n1")) == ["x"]

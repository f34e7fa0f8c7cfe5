"""Whole lines out of chunks from several sources; a reader that follows the files."""

from elasticd.logs import MAX_PARTIAL, READ_CHUNK, LineSplitter, LogReader, log_files

A = (0, 0, "out")
B = (0, 1, "err")


def texts(lines):
    return [(l["rank"], l["stream"], l["text"]) for l in lines]


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
    assert [(a, r, s) for a, r, s, _ in log_files(str(tmp_path), "j")] == \
        [(0, 0, "out"), (0, 1, "err"), (0, 10, "out"), (1, 0, "out")]
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

"""Whole lines out of chunks from several sources, with no repeats across file and bus."""

from elasticd.logs import MAX_PARTIAL, LineSplitter, log_files

A = (0, 0, "out")
B = (0, 1, "err")


def texts(lines):
    return [(l["rank"], l["stream"], l["text"]) for l in lines]


def test_lines_across_chunks_and_sources():
    s = LineSplitter()
    assert texts(s.feed(A, 0, b"he")) == []
    assert texts(s.feed(B, 0, b"x\r\ny")) == [(1, "err", "x")]
    assert texts(s.feed(A, 2, b"llo\nwor")) == [(0, "out", "hello")]
    assert texts(s.flush()) == [(0, "out", "wor"), (1, "err", "y")]


def test_overlap_between_file_and_live_chunks_is_dropped():
    s = LineSplitter()
    s.feed(A, 0, b"one\ntwo\nthr")           # what the file held when read
    assert texts(s.feed(A, 4, b"two\n")) == []   # a live chunk already in the file
    assert texts(s.feed(A, 8, b"three\nfour\n")) == [(0, "out", "three"), (0, "out", "four")]


def test_a_long_line_without_newline_is_cut():
    s = LineSplitter()
    out = s.feed(A, 0, b"x" * (MAX_PARTIAL + 1))
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

"""What a command prints: its one document (``--json``) or text, the error document, and a
progress line on a terminal."""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from typing import Any, TextIO


def emit(args: argparse.Namespace, doc: Any, human: Callable[[], str]) -> None:
    """The command's one output: the document itself with --json (exact: json.dumps escapes
    control characters), else its rendering (render escapes them)."""
    print(json.dumps(doc) if args.json else human(), flush=True)


def error_doc(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


class ProgressLine:
    """One line of progress: rewritten in place on a terminal (``width`` = its columns),
    else printed anew whenever its text changes."""

    def __init__(self, out: TextIO, width: int | None) -> None:
        self._out = out
        self._width = width
        self._shown: str | None = None

    def show(self, line: str) -> None:
        if line == self._shown:
            return
        if self._width:
            self._out.write("\r\x1b[K" + line[: self._width - 1])
        else:
            self._out.write(line + "\n")
        self._out.flush()
        self._shown = line

    def close(self) -> None:
        if self._width and self._shown is not None:
            self._out.write("\n")
            self._out.flush()
            self._shown = None


def terminal_width(out: TextIO) -> int | None:
    return shutil.get_terminal_size().columns if out.isatty() else None

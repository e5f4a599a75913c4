"""Batch input and durable output: every request id ends up in the output exactly once.

Input is a JSONL file, or a folder of ``*.jsonl`` files read in name order. A line is either the
OpenAI Batch API form ``{"custom_id", "method", "url", "body"}`` or a bare request body (``prompt``
for completions, ``messages`` for chat) with an optional ``id``. A line without an id gets
``<file name>:<line number>``, stable across restarts.

Output is one JSON line per id, appended, flushed and fsynced before the id counts as done. On open,
a torn last line (a crash mid-write) is cut off, and the ids already present are skipped, so a batch
that is preempted and resumed any number of times neither loses nor repeats an id. A corrupt line
elsewhere is never guessed at: the output is refused with the line's number (see ResultLog).
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import structlog

from cache_daemon import owned

log = structlog.get_logger(__name__)

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


class BatchInputError(ValueError):
    """The batch input cannot be used at all (missing, unreadable, empty folder)."""


class BatchOutputError(OSError):
    """The output file cannot be used (unwritable, not ours, full disk); the message names it."""

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno N]"
        return self.strerror or super().__str__()


class CorruptOutput(BatchOutputError):
    """A complete line of the output is not a result record: the batch cannot tell what is done."""

    def __init__(self, path: Path, lineno: int, why: str) -> None:
        super().__init__(f"line {lineno} of batch output {path} is not a result record ({why})")
        self.path, self.lineno = path, lineno


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One request to run, or one line that could not be parsed (``error`` set, ``body`` empty)."""

    id: str
    url: str
    body: dict[str, Any]
    source: str  # "<file>:<line>" for error messages
    error: str = ""


def input_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".jsonl" and p.is_file())
        if not files:
            raise BatchInputError(f"batch input folder {path} holds no *.jsonl file")
        return files
    if not path.is_file():
        raise BatchInputError(f"batch input {path} does not exist (give a .jsonl file or a folder of them)")
    return [path]


def parse_line(text: str, source: str) -> BatchItem:
    """Turn one input line into a BatchItem; a bad line becomes an item with ``error`` set."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BatchItem(id=source, url="", body={}, source=source, error=f"line is not JSON: {e.msg}")
    if not isinstance(obj, dict):
        return BatchItem(id=source, url="", body={}, source=source, error="line is not a JSON object")
    if "body" in obj:  # OpenAI Batch API form
        item_id, url, body = obj.get("custom_id") or obj.get("id") or source, obj.get("url"), obj["body"]
    else:
        body = {k: v for k, v in obj.items() if k != "id"}
        item_id = obj.get("id") or source
        url = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    item_id = str(item_id)
    if not isinstance(body, dict):
        return BatchItem(id=item_id, url="", body={}, source=source, error="'body' must be a JSON object")
    if url not in ENDPOINTS:
        return BatchItem(id=item_id, url="", body={}, source=source,
                         error=f"url must be one of {', '.join(ENDPOINTS)}, not {url!r}")
    needed = "messages" if url.endswith("chat/completions") else "prompt"
    if needed not in body:
        return BatchItem(id=item_id, url=url, body={}, source=source, error=f"request has no {needed!r}")
    if body.get("stream"):
        return BatchItem(id=item_id, url=url, body={}, source=source, error="batch requests cannot stream")
    return BatchItem(id=item_id, url=url, body=body, source=source)


def read_items(path: Path) -> Iterator[BatchItem]:
    """Every non-blank line of the input, in order. Duplicate ids: the later line is an error."""
    seen: set[str] = set()
    for file in input_files(path):
        with file.open(encoding="utf-8", errors="replace") as f:
            for lineno, text in enumerate(f, 1):
                if not text.strip():
                    continue
                item = parse_line(text, f"{file.name}:{lineno}")
                if item.id in seen and not item.error:
                    item = BatchItem(id=f"{file.name}:{lineno}", url="", body={}, source=item.source,
                                     error=f"duplicate id {item.id!r}")
                seen.add(item.id)
                yield item


class ResultLog:
    """Append-only, fsynced JSONL of results; knows which ids are done.

    Owns its file descriptor; one writer at a time (the batch runner of one service). The file must
    be ours (``cache_daemon.owned``): an output that another user planted, could write, or (beyond
    ``mode``) could read is refused, never trusted. An id is done only once its whole line is written
    and fsynced; a write that fails (a full disk) is cut back off and fails this log for good.

    On open, a last line without its newline is a torn append (a crash mid-write, or a failed write
    that could not be cut back): it is cut off, and its id runs again. A complete line that is not a
    result record is corruption, not a crash: ``CorruptOutput`` names the line and nothing is changed.
    """

    def __init__(self, path: Path, *, mode: int = 0o600) -> None:
        self.path = path
        self.failed: BatchOutputError | None = None  # the first write error; every later append raises it
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd, _ = owned.open_private_file(path, os.O_RDWR | os.O_APPEND, mode=mode, what="batch output")
        except owned.UntrustedPath as e:
            raise BatchOutputError(errno.EPERM, str(e)) from None
        except OSError as e:
            raise BatchOutputError(e.errno, f"cannot write batch output {path}: {e.strerror}") from e
        self.done: set[str] = set()
        try:
            self._recover()
        except BaseException:
            self.close()
            raise

    def _recover(self) -> None:
        with open(self._fd, "rb", closefd=False) as f:
            data = f.read()
        keep = data.rfind(b"\n") + 1
        for lineno, line in enumerate(data[:keep].split(b"\n")[:-1], 1):
            if not line.strip():
                continue
            try:
                rid = json.loads(line)["id"]
            except (ValueError, TypeError, KeyError) as e:  # not JSON, not an object, no id
                why = f"not JSON at column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else "no 'id'"
                raise CorruptOutput(self.path, lineno, why) from None
            self.done.add(str(rid))
        if keep != len(data):
            log.warning("batch_output_torn_tail_removed", path=str(self.path), bytes=len(data) - keep)
            os.ftruncate(self._fd, keep)
            os.fsync(self._fd)

    def append(self, record: dict[str, Any]) -> None:
        """Write one record durably. Records for ids already done are refused (no duplicates).

        Raises ``BatchOutputError`` when the line cannot be written whole and fsynced (ENOSPC,
        EDQUOT, EFBIG, EIO); the file is cut back to its last complete line.
        """
        if self.failed is not None:
            raise self.failed
        rid = record["id"]
        if rid in self.done:
            return
        line = memoryview((json.dumps(record, separators=(",", ":")) + "\n").encode())
        size = os.fstat(self._fd).st_size
        try:
            while line:  # a write may be short (a nearly full disk, a file size limit): write the rest
                line = line[os.write(self._fd, line):]
            os.fsync(self._fd)
        except OSError as e:
            self.failed = self._write_failed(e, size)
            raise self.failed from None
        self.done.add(rid)

    def _write_failed(self, e: OSError, size: int) -> BatchOutputError:
        try:
            os.ftruncate(self._fd, size)  # no torn line stays behind to be mistaken for a result
        except OSError:
            pass  # the next open cuts the torn tail off
        try:
            free = os.fstatvfs(self._fd)
            room = f"{free.f_bavail * free.f_frsize} bytes free there"
        except OSError:
            room = "free space unknown"
        return BatchOutputError(e.errno, f"cannot write batch output {self.path}: {e.strerror} ({room}, "
                                         f"{len(self.done)} results are in it)")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "ResultLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def error_record(item: BatchItem) -> dict[str, Any]:
    return {"id": item.id, "response": None, "error": {"message": item.error, "line": item.source}}


def result_record(item: BatchItem, status: int, body: Any) -> dict[str, Any]:
    return {"id": item.id, "response": {"status_code": status, "url": item.url, "body": body}, "error": None}

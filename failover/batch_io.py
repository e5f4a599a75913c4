"""Batch input and durable output: every request id ends up in the output exactly once.

Input is a JSONL file, or a folder of ``*.jsonl`` files read in name order. A line is either the
OpenAI Batch API form ``{"custom_id", "method", "url", "body"}`` or a bare request body (``prompt``
for completions, ``messages`` for chat) with an optional ``id``. A line without an id gets
``<file name>:<line number>``, stable across restarts.

Output is one JSON line per id, appended, flushed and fsynced before the id counts as done. On open,
a torn last line (a crash mid-write) is cut off, and the ids already present are skipped, so a batch
that is preempted and resumed any number of times neither loses nor repeats an id.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


class BatchInputError(ValueError):
    """The batch input cannot be used at all (missing, unreadable, empty folder)."""


class BatchOutputError(OSError):
    """The output file cannot be written; raised before any work is done."""


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

    Owns its file descriptor; one writer at a time (the batch runner of one service).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise BatchOutputError(e.errno, f"cannot write batch output {path}: {e.strerror}") from e
        self.done: set[str] = set()
        self._recover()

    def _recover(self) -> None:
        with open(self._fd, "rb", closefd=False) as f:
            data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep != len(data):  # torn last line from a crash mid-append
            os.ftruncate(self._fd, keep)
            os.fsync(self._fd)
        for line in data[:keep].splitlines():
            if line.strip():
                self.done.add(json.loads(line)["id"])

    def append(self, record: dict[str, Any]) -> None:
        """Write one record durably. Records for ids already done are refused (no duplicates)."""
        rid = record["id"]
        if rid in self.done:
            return
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())
        os.fsync(self._fd)
        self.done.add(rid)

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

"""Turning msgspec's validation messages into ones that name the key path and what is allowed.

``explain("Object contains unknown field `prot` - at `$.service[0]`", Config)`` ->
``service[0].prot: unknown key (did you mean 'port'?); allowed keys here: name, priority, ...``
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Literal, get_args, get_origin, get_type_hints

import msgspec


_TYPE_WORDS = {"int": "an integer", "str": "a string", "float": "a number", "bool": "true or false",
               "array": "an array", "object": "a table", "null": "absent"}


def explain(message: str, root: type) -> str:
    """One line for a msgspec.ValidationError message, against the Struct type ``root``."""
    text, _, where = message.partition(" - at `")
    path = where.rstrip("`").removeprefix("$").lstrip(".")
    struct = _struct_at(path, root)
    m = re.match(r"Object contains unknown field `(.+)`", text)
    if m:
        return unknown_key(path, m.group(1), struct)
    m = re.match(r"Object missing required field `(.+)`", text)
    if m:
        return f"{_join(path, m.group(1))}: required key is missing"
    if text.startswith("Invalid enum value"):
        allowed = _literal_values(path, root)
        return f"{path}: {text.removeprefix('Invalid enum value ')} is not allowed; allowed: {allowed}"
    m = re.match(r"Expected `(.+?)`(.*?)(?:, got `(.+)`)?$", text)
    if m:
        want = " or ".join(_TYPE_WORDS.get(t.strip(), t.strip()) for t in m.group(1).split("|")
                           if t.strip() != "null")
        got = f", got {_TYPE_WORDS.get(m.group(3), m.group(3))}" if m.group(3) else ""
        return f"{path}: expected {want}{m.group(2)}{got}"
    return f"{path or 'config'}: {text}"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def unknown_key(path: str, key: str, struct: type | None) -> str:
    allowed = ", ".join(f for f in struct.__struct_fields__ if f != "source") if struct else "?"
    close = [f for f in (struct.__struct_fields__ if struct else ()) if _similar(key, f)]
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{_join(path, key)}: unknown key{hint}; allowed keys here: {allowed}"


def _similar(a: str, b: str) -> bool:
    return difflib.SequenceMatcher(None, a, b).ratio() >= 0.75


def _resolve(path: str, root: type) -> object:
    """The annotated type at a key path such as ``service[0].batch``."""
    tp: object = root
    for part in filter(None, re.split(r"\.|\[\d+\]", path)):
        tp = _strip(tp)
        if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            tp = get_type_hints(tp, include_extras=True).get(part)
    return tp


def _strip(tp: object) -> object:
    """Peel Annotated, Optional and list[...] down to the element type."""
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            tp = get_args(tp)[0]
        elif origin is list:
            tp = get_args(tp)[0]
        elif origin is not None and type(None) in get_args(tp):
            tp = next(a for a in get_args(tp) if a is not type(None))
        else:
            return tp


def _struct_at(path: str, root: type) -> type | None:
    tp = _strip(_resolve(path, root)) if path else root
    return tp if isinstance(tp, type) and issubclass(tp, msgspec.Struct) else None


def _literal_values(path: str, root: type) -> str:
    tp = _strip(_resolve(path, root))
    return ", ".join(repr(v) for v in get_args(tp)) if get_origin(tp) is Literal else "?"

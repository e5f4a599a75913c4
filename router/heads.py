"""The lean listener's plain request head, read by one regular expression (router/front.py).

Issue 20 (router24): httptools made a parser object for every request and called back into Python
for every header. With an engine's forward pass between two requests that code runs cache-cold:
the parse was 62-66 us of the router's ~290 us critical path on a whole completion here; this one
is 44-48 us. (The same for the engine's answers was slower than httptools, 47-54 against 40-43 us;
router/answer_heads.py, router26, checks each distinct answer head once by the same pattern and
remembers it.) The head is checked by one match of a strict pattern and its fields split by one
``findall``, both in C; Python then looks at each field once.

The pattern accepts a subset of what RFC 9112 allows, and nothing that it does not:
- the request line is exactly ``GET|POST SP origin-form SP HTTP/1.1``;
- a field name is a token, with no space before its colon;
- a field value is visible ASCII, spaces, tabs and obs-text (no CR, LF, NUL or other control);
- no obs-fold, no bare LF.
A head outside that subset is not an error here: router/front.py hands the connection to aiohttp,
whose parser answers it as before. Every repetition is possessive, so a hostile head costs linear
time.
"""

from __future__ import annotations

import re

_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]++"
_VALUE = rb"[\t\x20-\x7e\x80-\xff]*+"
FIELDS = rb"(?:" + _TOKEN + rb":" + _VALUE + rb"\r\n)*+"  # (router/answer_heads.py too)
_REQUEST = re.compile(rb"(GET|POST) (/[!-~]*+) HTTP/1\.1\r\n(" + FIELDS + rb")\r\n")
FIELD = re.compile(rb"(" + _TOKEN + rb"):(" + _VALUE + rb")\r\n")

# A request with one of these goes to aiohttp's path (router/front.py): framing or semantics the
# lean listener does not handle.
REFUSED = frozenset({b"transfer-encoding", b"content-encoding", b"expect", b"upgrade"})


class Request:
    """A plain request's head: ``fields`` as (name, value) with the value's whitespace stripped,
    ``forward`` the lines of those not in ``request``'s ``drop`` (as they go upstream)."""

    __slots__ = ("method", "path", "fields", "forward", "length", "keep_alive", "size")

    def __init__(self, method: bytes, path: bytes, fields: list, forward: list, length: int | None,
                 keep_alive: bool, size: int) -> None:
        self.method, self.path, self.fields, self.forward, self.length = method, path, fields, forward, length
        self.keep_alive, self.size = keep_alive, size  # size: the head's bytes, with its blank line


def request(head: bytes, drop: frozenset) -> Request | None:
    """The plain request head at the start of ``head`` (bytes, all of it there), or None: not plain
    (a method, version or byte outside the subset above, a second Content-Length or a non-digit
    one, a field in ``REFUSED``). ``drop``: lower-case names kept out of ``forward``."""
    m = _REQUEST.match(head)
    if m is None:
        return None
    fields, forward, length, keep_alive = [], [], None, True
    for name, value in FIELD.findall(m.group(3)):
        value = value.strip(b" \t")
        lname = name.lower()
        if lname == b"content-length":
            if length is not None or not value.isdigit():
                return None
            length = int(value)
        elif lname == b"connection":
            keep_alive = b"close" not in [t.strip().lower() for t in value.split(b",")]
        elif lname in REFUSED:
            return None
        fields.append((name, value))
        if lname not in drop:
            forward.append(b"%b: %b\r\n" % (name, value))
    return Request(m.group(1), m.group(2), fields, forward, length, keep_alive, m.end())

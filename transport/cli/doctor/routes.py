"""How the doctor reads UCX's choices: the tables ``UCX_PROTO_INFO=y`` prints, per endpoint
configuration and operation, and the line the loopback probe marks with its figures."""

from __future__ import annotations

import re

from transport.cli.doctor.report import Route

RESULT_MARK = "TRANSPORT-DOCTOR-RESULT "

#: a UCX table's title -> the operation it is about (the first of each kind UCX prints)
_OPERATIONS = (
    ("remote memory write by ucp_put*", "put"),
    ("remote memory read by ucp_get*", "get"),
    ("active message by ucp_am_send*", "notification"),
)
_HEADER = re.compile(r"\S+ (self|intra-node|inter-node) cfg#\d+")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*/[A-Za-z0-9_:.\-]+)")


def parse_routes(text: str, between: str) -> list[Route]:
    """The transports UCX reported (``UCX_PROTO_INFO=y``) for each operation between two
    processes (its ``intra-node`` or ``inter-node`` tables; ``self`` is a process with itself)."""
    found: dict[str, list[str]] = {}
    kind = title = None
    for raw in text.splitlines():
        cells = [c.strip() for c in raw.split("|")[1:-1]]
        if not cells:
            continue
        header = _HEADER.search(cells[0]) if len(cells) == 1 else None
        if header is not None:
            kind, title = header.group(1), None
            continue
        if len(cells) == 1 and kind is not None:  # the title of the next table
            title = cells[0]
            continue
        if kind in (None, "self") or title is None or len(cells) < 3 or cells[0] == "Range":
            continue
        for prefix, op in _OPERATIONS:
            if title.startswith(prefix):  # its variants ("(multi)", "with reply flag") too
                memory = re.search(r"(?:from|into) (\w+) memory", title)
                if memory is not None and memory.group(1) != "host":
                    op = f"{op} ({memory.group(1)} memory)"
                seen = found.setdefault(op, [])
                for tr in _TRANSPORT.findall(cells[-1]):
                    if tr not in seen:
                        seen.append(tr)
    return [Route(between, op, tuple(trs)) for op, trs in found.items()]

"""The flags of ``ls``, ``verify`` and ``gc`` that set no settings field: rows of the options table too.

No environment variable stands in for them, and each carries its own default (``schema.Option.own_default``).
"""

from __future__ import annotations

from sidecar.cli import schema
from sidecar.core import parse
from sidecar.shared import gc

OWN: tuple[schema.Option, ...] = (
    schema.Option(
        "--json", "", (), "print the manifests as JSON lines", switch=True, commands=frozenset({schema.Command.LS})
    ),
    schema.Option(
        "--model",
        "",
        (),
        "router mode (--router): only this model's snapshots",
        "NAME",
        commands=frozenset({schema.Command.LS}),
    ),
    schema.Option(
        "--dry-run",
        "",
        (),
        "report bad files without quarantining them",
        switch=True,
        commands=frozenset({schema.Command.VERIFY}),
    ),
    schema.Option(
        "--max-age",
        "",
        (),
        "unpublish snapshots uploaded more than SEC seconds ago; 0 = no age limit (default 0)",
        "SEC",
        parse.number(float, zero_ok=True),
        commands=frozenset({schema.Command.GC}),
        own_default=0.0,
    ),
    schema.Option(
        "--max-bytes",
        "",
        (),
        "then unpublish the oldest until the snapshots kept hold at most N bytes; 0 = no cap (default 0)",
        "N",
        parse.number(int, zero_ok=True),
        commands=frozenset({schema.Command.GC}),
        own_default=0,
    ),
    schema.Option(
        "--grace",
        "",
        (),
        "delete an unpublished snapshot's object only SEC seconds later, so downloads in flight finish "
        f"(default {gc.GRACE:g})",
        "SEC",
        parse.number(float, zero_ok=True),
        commands=frozenset({schema.Command.GC}),
        own_default=gc.GRACE,
    ),
    schema.Option(
        "--dry-run",
        "",
        (),
        "print what would be deleted, delete nothing",
        switch=True,
        commands=frozenset({schema.Command.GC}),
    ),
)
"""The flags of ``ls``, ``verify`` and ``gc`` that set no settings field (no variable stands in for them)."""

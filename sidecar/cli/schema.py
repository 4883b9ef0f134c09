"""What a row of the options table says (:mod:`sidecar.cli.options`): flag, variable, settings field, help, commands.

A setting's default is written once, in ``config.py``: the row reads it from there
(:attr:`Option.default`) and shows it in its help with its variable (:attr:`Option.help_text`).
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Callable
from typing import Any

from sidecar.core import config

GROUPS: dict[str, type[Any]] = {
    name: kind
    for name, kind in typing.get_type_hints(config.Settings).items()
    if isinstance(kind, type) and dataclasses.is_dataclass(kind)
}
"""The groups of ``config.Settings`` by field name: ``{"upstream": config.UpstreamSettings, ...}``."""


class Command(enum.StrEnum):
    RUN = "run"
    LS = "ls"
    VERIFY = "verify"
    GC = "gc"


@dataclasses.dataclass(frozen=True, slots=True)
class Option:
    flag: str
    env: str
    """The environment variable that stands in for the flag; "" for none (a command's own flag: ``ls --json``)."""
    fields: tuple[str, ...]
    """``group.name`` of the ``config.Settings`` field(s) the option sets; () for a command's own flag."""
    help: str
    metavar: str | None = None
    convert: Callable[[str], Any] = str
    """Turns the text into a value; argparse reports its errors (exit 2)."""
    check: Callable[[Any], Any] | None = None
    """Validates the parsed value; raises ``errors.ConfigError``. Returns a tuple for several fields."""
    choices: tuple[str, ...] | None = None
    switch: bool = False
    """A flag without a value; the variable takes 1/0, true/false, yes/no, on/off."""
    commands: frozenset[Command] = frozenset({Command.RUN})
    """The commands that take the option."""
    own_default: Any = None
    """The default of a command's own flag (one that sets no settings field); the others take config.py's."""

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def group(self) -> str:
        """The settings group the option sets (``snapshots``, ``proxy``, ...), or the command of its own flag."""
        return self.fields[0].split(".")[0] if self.fields else min(self.commands)

    @property
    def default(self) -> Any:
        """The value taken when neither flag nor variable is set: config.py's (a tuple for several fields, as
        ``--listen``'s host and port), or the command's own; None when computed at start or left unset."""
        if not self.fields:
            return self.own_default
        found = [_default(field) for field in self.fields]
        if any(d is None or d is dataclasses.MISSING for d in found):
            return None
        return found[0] if len(found) == 1 else tuple(found)

    @property
    def shown_default(self) -> str | None:
        """The default as the help shows it (``127.0.0.1:9464``); None for a switch or a setting without one."""
        if self.switch or not self.fields or self.default is None:
            return None
        return ":".join(str(d) for d in (self.default if len(self.fields) > 1 else (self.default,)))

    @property
    def help_text(self) -> str:
        """The help argparse shows: a setting's names its default and its variable."""
        if not self.env:
            return self.help
        shown = "" if self.shown_default is None else f" (default {self.shown_default})"
        return f"{self.help}{shown} [{self.env}]"


def _default(field: str) -> Any:
    group, name = field.split(".")
    return {f.name: f.default for f in dataclasses.fields(GROUPS[group])}[name]

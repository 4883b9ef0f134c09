"""The command line read through the options table (:mod:`sidecar.cli.options`): the parser's arguments
built from its rows, and ``run``'s settings read back from flags, environment variables and defaults.

The flags are added to argparse with the default ``None``; :func:`settings_from` then takes each
field from its flag, else from its environment variable, else leaves it to the default written in
``config.py``. Values argparse cannot convert exit with status 2; a check that fails raises
``errors.ConfigError`` (status 2 as well, from ``main``).
"""

from __future__ import annotations

import argparse
import enum
import os
from pathlib import Path
from typing import Any

from sidecar.cli import options, schema
from sidecar.core import config, errors


def add(parser: argparse.ArgumentParser, command: schema.Command) -> None:
    """Add the options ``command`` takes to ``parser``; a setting's with the default None, its help naming
    default and variable (its value is read by :func:`settings_from` or :func:`checked_value`)."""
    for option in options.of(command):
        text = option.help_text.replace("%", "%%")
        if option.switch and not option.fields:
            parser.add_argument(option.flag, action="store_true", help=text)
        elif option.switch and option.flag.startswith("--no-"):
            # argparse's BooleanOptionalAction reads a flag spelt --no-X as its own negative form (False)
            parser.add_argument(option.flag, action="store_const", const=True, default=None, help=text)
        elif option.switch:
            parser.add_argument(option.flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            parser.add_argument(
                option.flag,
                default=option.own_default,
                type=option.convert,
                choices=option.choices,
                metavar=option.metavar,
                help=text,
            )


class Source(enum.IntEnum):
    ENV = 1
    FLAG = 2


def raw_value(ns: argparse.Namespace, option: schema.Option) -> tuple[Any, Source] | None:
    """The option's parsed value and where it came from; None when neither flag nor variable is set.

    An empty variable counts as unset (``LLAMA_API_KEY=`` in a Compose file means no key).
    """
    parsed = getattr(ns, option.dest, None)
    if parsed is not None:
        return parsed, Source.FLAG
    text = os.environ.get(option.env, "") if option.env else ""
    if not text:
        return None
    try:
        parsed = option.convert(text)
    except argparse.ArgumentTypeError as exc:
        raise errors.ConfigError(f"{option.env}={text!r} is not valid for {option.flag}: {exc}") from None
    if option.choices is not None and parsed not in option.choices:
        raise errors.ConfigError(f"{option.env}={text!r}: {option.flag} is one of {', '.join(option.choices)}")
    return parsed, Source.ENV


def checked_value(ns: argparse.Namespace, option: schema.Option) -> Any:
    """The option's value after its check, or None."""
    found = raw_value(ns, option)
    if found is None:
        return None
    return option.check(found[0]) if option.check is not None else found[0]


PENDING_SLOT_DIR = Path("/")
"""The slot dir of launcher-mode settings until the launcher picks it (see ``settings_from``)."""


def settings_from(ns: argparse.Namespace, *, launching: bool = False) -> config.Settings:
    """Settings of ``run``: each field from its flag, else its variable, else config.py's default.

    Two options that set the same field (``--api-key`` and ``--api-key-file``) may not both be
    given at the same level; a flag wins over a variable. ``launching``: launcher mode, where the
    slot dir may be left to the launcher (:data:`PENDING_SLOT_DIR` until it is picked).
    """
    winners: dict[tuple[str, ...], tuple[Source, schema.Option, Any]] = {}
    for option in options.OPTIONS:
        found = raw_value(ns, option)
        if found is None:
            continue
        parsed, source = found
        before = winners.get(option.fields)
        if before is not None and before[0] == source:
            named = (before[1].flag, option.flag) if source is Source.FLAG else (before[1].env, option.env)
            raise errors.ConfigError(f"{named[0]} and {named[1]} are both set: give one of them")
        if before is None or source > before[0]:
            winners[option.fields] = (source, option, parsed)
    groups: dict[str, dict[str, Any]] = {name: {} for name in schema.GROUPS}
    for fields, (_, option, parsed) in winners.items():
        checked = option.check(parsed) if option.check is not None else parsed
        if checked is None:
            continue
        for field, part in zip(fields, checked if len(fields) > 1 else (checked,), strict=True):
            group, name = field.split(".")
            groups[group][name] = part
    if "slot_dir" not in groups["snapshots"]:
        if not launching:
            raise errors.ConfigError(
                f"{options.SLOT_DIR.flag} (or {options.SLOT_DIR.env}) is required beside a llama-server started "
                "elsewhere: its --slot-save-path; or let the sidecar start it: "
                "llama-kv-sidecar run -- llama-server ARGS..."
            )
        groups["snapshots"]["slot_dir"] = PENDING_SLOT_DIR
    settings = config.Settings(**{name: schema.GROUPS[name](**fields) for name, fields in groups.items()})
    if settings.server.status_requires_token and not settings.server.admin_token:
        raise errors.ConfigError(
            "--status-requires-token needs an admin token: set --admin-token-file (or --admin-token)"
        )
    if settings.upstream.router and settings.shared.location is not None:
        raise errors.ConfigError(
            "--shared-store is not offered with --router: snapshots are shared between plain llama-servers"
            " only; drop one of the two"
        )
    return settings

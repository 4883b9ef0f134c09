"""The options table (sidecar/cli/options.py) is well formed: each row's fields, group, default and commands."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sidecar.cli import options, schema
from sidecar.core import config


def test_each_option_sets_fields_of_one_settings_group_or_none_at_all() -> None:
    for option in options.TABLE:
        groups = {field.split(".")[0] for field in option.fields}
        if option.fields:
            assert groups == {option.group}, option.flag
            names = {f.name for f in dataclasses.fields(schema.GROUPS[option.group])}
            assert {field.split(".")[1] for field in option.fields} <= names, option.flag
            assert option.env.startswith("LLAMA_"), option.flag
        else:  # a command's own flag: no variable, its default in the row
            assert option.env == "", option.flag
            assert schema.Command.RUN not in option.commands, option.flag
            assert option.group in {c.value for c in option.commands}, option.flag


def test_a_setting_takes_its_default_from_config_and_an_own_flag_from_its_row() -> None:
    by_flag = {(min(o.commands).value, o.flag): o for o in options.TABLE}
    assert by_flag["run", "--poll-interval"].default == config.PollSettings().interval
    assert by_flag["run", "--listen"].default == (config.ServerSettings().host, config.ServerSettings().port)
    assert by_flag["run", "--listen"].shown_default == "127.0.0.1:9464"
    assert by_flag["run", "--proxy-listen"].default is None  # computed at start, or off
    assert by_flag["gc", "--max-age"].default == 0.0
    assert by_flag["run", "--max-age"].default == config.SnapshotSettings(slot_dir=Path("/")).max_age


def test_each_command_takes_its_rows_and_run_takes_every_setting() -> None:
    assert options.of(schema.Command.RUN) == options.OPTIONS
    stores = [options.STATE_DIR.flag, options.SLOT_DIR.flag, options.STORE_DIR.flag]
    assert [o.flag for o in options.of(schema.Command.LS)] == [*stores, "--json", "--model"]
    assert [o.flag for o in options.of(schema.Command.VERIFY)] == [*stores, "--dry-run"]
    gc = [o.flag for o in options.of(schema.Command.GC)]
    assert gc == [options.SHARED_STORE.flag, "--max-age", "--max-bytes", "--grace", "--dry-run"]
    flags = [o.flag for o in options.OPTIONS]
    assert len(flags) == len(set(flags)), "a flag is one row of run's table"

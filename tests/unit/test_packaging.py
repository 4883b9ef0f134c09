"""The distribution ships every package of the sidecar: an installed (non-editable) copy imports them all."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_sidecar_package_is_listed_for_the_wheel() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "sidecar").rglob("__init__.py")}
    assert "sidecar.router" in found
    assert found - listed == set(), (
        "packages missing from [tool.setuptools] packages: pip install . would leave them out"
    )
    assert listed - found == set(), "[tool.setuptools] packages names folders that are not packages"

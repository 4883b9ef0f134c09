"""The distribution ships every package of the sidecar: an installed (non-editable) copy imports them all."""

from __future__ import annotations

import importlib.metadata
import re
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


S3_CLIENTS = {"aiobotocore", "botocore", "boto3", "obstore", "s3fs", "minio"}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_a_plain_install_names_no_s3_client_and_the_s3_extra_does() -> None:
    """`pip install .` pulls no S3 client; `[s3]` does; the test extras and the image keep it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {_name(r) for r in project["dependencies"]} & S3_CLIENTS == set()
    extras = project["optional-dependencies"]
    assert {_name(r) for r in extras["s3"]} == {"aiobotocore"}
    assert "llama-kv-sidecar[s3]" in extras["test"]
    # The metadata pip installs from: requirements without an `extra ==` marker are what `pip install .` pulls.
    installed = importlib.metadata.requires("llama-kv-sidecar") or []
    plain = {_name(r) for r in installed if "extra ==" not in r}
    assert "aiohttp" in plain
    assert plain & S3_CLIENTS == set(), f"pip install . would pull {plain & S3_CLIENTS}"
    assert any(_name(r) == "aiobotocore" and 'extra == "s3"' in r for r in installed)


def test_no_two_test_files_share_a_name() -> None:
    """pytest imports test files by their base name (no __init__.py in the folders): two of one name stop collection."""
    names = [path.name for path in Path(__file__).parents[1].glob("*/test_*.py")]
    assert sorted(name for name in set(names) if names.count(name) > 1) == []

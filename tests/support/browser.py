"""A real browser for the tests: Debian's headless Chromium, driven from its command line.

``chromium --headless --dump-dom URL`` prints the DOM after the page loaded
(what a person's browser would show, parsed and laid out by Blink), and
``--screenshot`` renders it to a PNG. No driver is needed for that. A
missing browser fails the test with the command that installs it
(``scripts/test`` installs it on a fresh machine, as it does Prometheus).
"""

from __future__ import annotations

import html.parser
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

INSTALL = "apt-get update && apt-get install -y chromium (Debian's package; scripts/test installs it when run as root)"
TIMEOUT = 90.0


class BrowserError(RuntimeError):
    """Chromium is missing or could not render the page."""


def binary() -> str:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    raise BrowserError(f"chromium is not installed: {INSTALL}")


def _run(url: str, *flags: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        args = [
            binary(),
            "--headless",
            "--disable-gpu",
            "--no-first-run",
            "--disable-extensions",
            "--disable-background-networking",
            f"--user-data-dir={profile}",
            *flags,
            url,
        ]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
        proc = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT, check=False)
    if proc.returncode != 0:
        raise BrowserError(f"chromium exited {proc.returncode} on {url}: {proc.stderr[-1500:]}")
    return proc


def dump_dom(url: str, *, width: int = 1100, height: int = 900) -> str:
    """The page's DOM as the browser built it, serialised."""
    return _run(url, f"--window-size={width},{height}", "--dump-dom").stdout


def screenshot(url: str, path: Path, *, width: int, height: int) -> Path:
    """Render ``url`` at ``width`` x ``height`` CSS pixels into the PNG ``path``."""
    _run(url, f"--window-size={width},{height}", "--hide-scrollbars", f"--screenshot={path}")
    if not path.is_file() or path.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
        raise BrowserError(f"chromium wrote no PNG at {path}")
    return path


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


class Dom(html.parser.HTMLParser):
    """What a person reads on the page, from the browser's DOM: text, figures, table rows, references."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.figures: dict[str, float] = {}
        self.figure_text: dict[str, str] = {}
        self.tables: dict[str, list[list[str]]] = {}
        self.references: list[str] = []
        self.chunks: list[str] = []
        self._table: str | None = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None
        self._figure: str | None = None
        self._depth = 0
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        for key in ("src", "href", "action", "data", "poster"):
            if key in a:
                self.references.append(a[key])
        if "data-figure" in a:
            self.figures[a["data-figure"]] = float(a["data-value"])
            self._figure, self._depth = a["data-figure"], 0
            self.figure_text[self._figure] = ""
        elif self._figure is not None and tag == "div":
            self._depth += 1
        if tag == "table":
            self._table = a.get("data-table", "")
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._row is not None and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._table is not None and self._row is not None:
            self.tables[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None
        elif tag == "div" and self._figure is not None:
            if self._depth == 0:
                self._figure = None
            else:
                self._depth -= 1

    def handle_data(self, data: str) -> None:
        self.chunks.append(data)
        if self._cell is not None:
            self._cell.append(data)
        if self._figure is not None:
            self.figure_text[self._figure] += data

    @property
    def text(self) -> str:
        return " ".join(" ".join(self.chunks).split())

    def rows(self, table: str) -> list[dict[str, str]]:
        """The rows of ``data-table=table`` as {heading: cell}."""
        head, *body = self.tables.get(table, [[]])
        return [dict(zip(head, row, strict=True)) for row in body]

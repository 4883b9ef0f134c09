"""The status page's HTML: a template over :class:`sidecar.app.view.Page`. Pure code.

One self-contained document: inline CSS, inline SVG charts, no script, no
font, no image and no request to anywhere but the page itself (the icon is
an empty ``data:`` URL), so it works offline and behind any proxy. It
refreshes itself (``<meta http-equiv="refresh">``), reads on a phone (a
viewport meta, tables that scroll sideways) and escapes every value it
prints with :func:`html.escape`.
"""

from __future__ import annotations

import html

from sidecar.app import history, view

REFRESH_SECONDS = 10
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"
"""Content-Security-Policy of the page: it loads nothing, runs no script, and its only styles are inline."""
CHART_W, CHART_H, PAD = 320, 90, 4

_CSS = """
body{font:15px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;background:#f6f7f9;color:#1d2329}
header{background:#1d2329;color:#fff;padding:.8em 1em;display:flex;flex-wrap:wrap;gap:.4em 1em;align-items:center}
header h1{font-size:1.15em;margin:0;font-weight:600}
main{padding:.5em 1em 2em;max-width:1100px;margin:auto}
section{background:#fff;border-radius:8px;padding:.6em 1em;margin:.8em 0;box-shadow:0 1px 2px #0001}
h2{font-size:1em;margin:.2em 0 .5em}
.state{padding:.1em .6em;border-radius:1em;font-weight:600}
.good{color:#0a6b2d}.bad{color:#b3261e}.wait{color:#8a5a00}
.state.good{background:#d7f5e0}.state.bad{background:#fde0dd}.state.wait{background:#fff0c7}
.figs{display:grid;grid-template-columns:repeat(auto-fit,minmax(150px,1fr));gap:.6em}
.fig{background:#fff;border-radius:8px;padding:.5em .8em;box-shadow:0 1px 2px #0001}
.fig .v{font-size:1.7em;font-weight:650}.fig .l{font-size:.85em;color:#55606b}.fig .n{font-size:.78em;color:#55606b}
.fig.hero{grid-column:1/-1;background:#0a6b2d;color:#fff}.fig.hero .l,.fig.hero .n{color:#d7f5e0}
.scroll{overflow-x:auto}
table{border-collapse:collapse;width:100%;font-size:.9em}
th,td{text-align:left;padding:.25em .5em;border-bottom:1px solid #e6e8eb;white-space:nowrap}
th{color:#55606b;font-weight:600}
tr.good td:first-child{box-shadow:inset 3px 0 #0a6b2d}tr.bad td:first-child{box-shadow:inset 3px 0 #b3261e}
tr.wait td:first-child{box-shadow:inset 3px 0 #d49a00}
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(280px,1fr));gap:.8em}
svg{width:100%;height:auto;background:#fafbfc;border-radius:4px}
.muted{color:#55606b;font-size:.85em}
dl{display:grid;grid-template-columns:max-content 1fr;gap:.15em 1em;margin:0;font-size:.9em}
dt{color:#55606b}dd{margin:0;word-break:break-all}
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _pairs(rows: tuple[tuple[str, str], ...]) -> str:
    return "<dl>" + "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in rows) + "</dl>"


def _table(heads: tuple[str, ...], rows: tuple[view.Row, ...], empty: str, key: str) -> str:
    if not rows:
        return f'<p class="muted" data-empty="{_e(key)}">{_e(empty)}</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in heads)
    body = "".join(f'<tr class="{_e(r.tone)}">' + "".join(f"<td>{_e(c)}</td>" for c in r.cells) + "</tr>" for r in rows)
    return f'<div class="scroll"><table data-table="{_e(key)}"><tr>{head}</tr>{body}</table></div>'


def _figure(fig: view.Figure, hero: bool) -> str:
    note = f'<div class="n">{_e(fig.note)}</div>' if fig.note else ""
    return (
        f'<div class="fig{" hero" if hero else ""}" data-figure="{_e(fig.key)}" data-value="{fig.value:.6g}">'
        f'<div class="l">{_e(fig.label)}</div><div class="v">{_e(fig.text)}</div>{note}</div>'
    )


def _label(value: float, unit: str) -> str:
    if unit == "share":
        return f"{value:.0%}"
    if unit == "seconds":
        return view.seconds_text(value)
    return f"{value:g}"


def chart(c: view.Chart) -> str:
    """An inline SVG bar or line chart of ``c.points`` (None values leave a gap)."""
    known = [p for p in c.points if p.value is not None]
    title = f"<title>{_e(c.title)}</title>"
    if len(c.points) < 1 or not known:
        return (
            f'<svg viewBox="0 0 {CHART_W} {CHART_H}" role="img" aria-label="{_e(c.title)}">{title}'
            f'<text x="{CHART_W / 2}" y="{CHART_H / 2}" text-anchor="middle" font-size="12" fill="#55606b">'
            "no data yet: a sample a minute</text></svg>"
        )
    top = 1.0 if c.unit == "share" else max(*(p.value or 0.0 for p in known), 1e-9)
    t0, t1 = c.points[0].at, c.points[-1].at
    span = max(t1 - t0, 1.0)
    inner_w, inner_h = CHART_W - 2 * PAD, CHART_H - 2 * PAD - 12

    def x(at: float) -> float:
        return PAD + (at - t0) / span * inner_w if len(c.points) > 1 else CHART_W / 2

    def y(value: float) -> float:
        return PAD + 12 + inner_h * (1 - value / top)

    shapes: list[str] = []
    if c.bars:
        width = max(2.0, inner_w / max(len(c.points), 1) - 1)
        for p in c.points:
            if p.value is None:
                continue
            left = min(max(PAD, x(p.at) - width / 2), CHART_W - PAD - width)
            shapes.append(
                f'<rect x="{left:.1f}" y="{y(p.value):.1f}" width="{width:.1f}" '
                f'height="{max(0.5, y(0) - y(p.value)):.1f}" fill="#2f6fdb"/>'
            )
    else:
        line = " ".join(f"{x(p.at):.1f},{y(p.value):.1f}" for p in known if p.value is not None)
        shapes.append(f'<polyline points="{line}" fill="none" stroke="#0a6b2d" stroke-width="2"/>')
    last = known[-1].value or 0.0
    peak = _label(top, c.unit)
    return (
        f'<svg viewBox="0 0 {CHART_W} {CHART_H}" role="img" aria-label="{_e(c.title)}">{title}'
        f'<line x1="{PAD}" y1="{y(0):.1f}" x2="{CHART_W - PAD}" y2="{y(0):.1f}" stroke="#c9ced4"/>'
        + "".join(shapes)
        + f'<text x="{PAD}" y="11" font-size="11" fill="#55606b">max {_e(peak)} · now {_e(_label(last, c.unit))}'
        "</text></svg>"
    )


def _charts(p: view.Page) -> str:
    return "".join(
        f'<div data-chart="{_e(c.title)}"><h2>{_e(c.title)}</h2>{chart(c)}'
        f'<div class="muted">{_e(_span(c.points))}</div></div>'
        for c in p.charts
    )


def _span(points: tuple[history.Point, ...]) -> str:
    if len(points) < 2:
        return "since the sidecar started"
    return f"last {view.seconds_text(points[-1].at - points[0].at)}"


def render(p: view.Page) -> str:
    figures = "".join(_figure(f, i == 0) for i, f in enumerate(p.figures))
    problems = "".join(f'<p class="bad">{_e(x)}</p>' for x in p.problems)
    more = (
        f'<p class="muted">and {p.library_more} more (llama-kv-sidecar ls lists them all)</p>' if p.library_more else ""
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width,initial-scale=1">
<meta http-equiv="refresh" content="{REFRESH_SECONDS}">
<link rel="icon" href="data:,">
<title>llama-kv-sidecar: {_e(p.state)}</title>
<style>{_CSS}</style></head>
<body><header><h1>llama-kv-sidecar</h1>
<span class="state {_e(p.tone)}" data-state="{_e(p.state)}">llama-server {_e(p.state)}</span>
<span class="muted">{_e(p.generated)} · refreshes every {REFRESH_SECONDS} s · sidecar {_e(p.version)}</span></header>
<main>{problems}
<div class="figs">{figures}</div>
<section><h2>Over time</h2><div class="charts">{_charts(p)}</div></section>
<section><h2>Restores and swaps</h2>
{
        _table(
            ("when", "by", "slot", "tokens", "call", "verdict", "reused", "saved"),
            p.acts,
            "none yet: a restore follows a restart of llama-server, a swap a conversation's return",
            "acts",
        )
    }
<h2>Last restore round</h2>
{_table(("when", "slot", "result", "tokens", "detail"), p.last_round, "no restore round yet", "round")}</section>
<section><h2>Slots</h2>
{_table(("slot", "state", "tokens / context", "holds", "changed"), p.slots, "not read yet", "slots")}</section>
<section><h2>Conversations in the library</h2>
{
        _table(
            ("conversation", "slot", "tokens", "size", "last use", "where"),
            p.library,
            "none: the library holds snapshots indexed by content (see llama-kv-sidecar ls)",
            "library",
        )
    }{more}</section>
<section><h2>Disk</h2>{_pairs(p.disk)}</section>
<section><h2>Server</h2>{_pairs(p.server)}</section>
</main></body></html>
"""

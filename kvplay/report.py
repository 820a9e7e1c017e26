"""One self-contained HTML file with every table and plot, for people who don't run Python.

plotly.js is inlined once, so the file opens offline in any browser.
"""
from __future__ import annotations

import html
import json
from datetime import datetime, timezone

from . import plots
from .results import CapacityResult, CompareResult, MemoryResult, PplResult, ThroughputResult, to_dict


def _table(rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in keys)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(k, '')))}</td>" for k in keys) + "</tr>"
                   for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _figures(result) -> list:
    if isinstance(result, CompareResult):
        return list(plots.compare_figures(result).values())
    if isinstance(result, MemoryResult):
        figs = [plots.memory_figure(result)]
        figs += [plots.projection_figure(result, arch, log=True) for arch in list(result.projections)[:3]]
        return figs
    if isinstance(result, ThroughputResult):
        figs = [plots.throughput_figure(result, "batch")]
        if any(c.context_points for c in result.caches):
            figs.append(plots.throughput_figure(result, "context"))
        return figs
    if isinstance(result, PplResult):
        return [plots.ppl_kl_figure(result), plots.layer_error_figure(result)]
    return []


def _generations(result: CompareResult) -> str:
    """Each spec's text with the tokens that differ from the baseline marked."""
    out = []
    for run in result.caches:
        differs = set()
        for a, b in run.diff_spans:
            differs.update(range(a, b))
        text = "".join(f"<mark>{html.escape(t)}</mark>" if i in differs else html.escape(t)
                       for i, t in enumerate(run.tokens))
        out.append(f"<h4>{html.escape(run.spec)}</h4><pre class='gen'>{html.escape(result.prompt)}{text}</pre>")
    return "".join(out)


TITLES = {CompareResult: "Compare", MemoryResult: "Memory against context", ThroughputResult: "Throughput",
          PplResult: "Quality on held-out text", CapacityResult: "What fits on the GPU"}


def build_report(results: list, title: str = "kvplay report") -> str:
    sections, first_plot = [], True
    for result in results:
        parts = [f"<h2>{TITLES[type(result)]}</h2>"]
        env = getattr(result, "env", None)
        if env is not None:
            parts.append(f"<p class='env'>{html.escape(env.model)} · {env.dtype} · {env.device} · torch "
                         f"{env.torch} · transformers {env.transformers}</p>")
        if isinstance(result, CapacityResult):
            parts.append(f"<p>{html.escape(result.arch)} on {result.gpu_gib} GiB, {result.weight_dtype} weights. "
                         f"{html.escape(result.note)}</p>")
        parts.append(_table(result.summary_rows()))
        if isinstance(result, CompareResult):
            parts.append(_generations(result))
        for fig in _figures(result):
            parts.append(fig.to_html(full_html=False, include_plotlyjs="inline" if first_plot else False))
            first_plot = False
        sections.append("<section>" + "".join(parts) + "</section>")
    data = json.dumps([to_dict(r) for r in results]).replace("</", "<\\/")  # safe inside <script>
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.85em; margin: 1em 0; }}
th, td {{ border: 1px solid #ddd; padding: 4px 8px; text-align: right; }}
th {{ background: #f4f4f4; }}
pre.gen {{ white-space: pre-wrap; background: #fafafa; padding: 0.8em; border-left: 3px solid #ccc; }}
mark {{ background: #ffd6d6; }}
.env {{ color: #666; font-size: 0.85em; }}
</style></head><body>
<h1>{html.escape(title)}</h1><p class="env">Generated {stamp} by kvplay.</p>
{''.join(sections)}
<script type="application/json" id="kvplay-data">{data}</script>
</body></html>"""


def write_report(results: list, path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(build_report(results))

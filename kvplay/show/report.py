"""One self-contained HTML file with every table and plot, for people who don't run Python.

plotly.js is inlined once, so the file opens offline in any browser.
"""
from __future__ import annotations

import html
import json
from datetime import UTC, datetime

from kvplay.results import (
    INSIDE,
    TRADEOFFS,
    AdviseResult,
    AttentionShift,
    CapacityResult,
    CompareResult,
    KeptResult,
    MemoryResult,
    NeedleResult,
    OutliersResult,
    PplResult,
    ThroughputResult,
    is_result,
    to_dict,
)
from kvplay.show import advise, plots, tables, tradeoffs
from kvplay.show import cards as render
from kvplay.show import inside as inside_plots

PROMPT_TAIL = 300        # characters of the prompt shown before "show the whole prompt"
FOLD_ROWS = 40           # longer tables are folded under a summary line


def _table(rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in keys)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(k, '')))}</td>" for k in keys) + "</tr>"
                   for r in rows)
    table = f"<div class='scroll'><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
    if len(rows) > FOLD_ROWS:     # a row per layer and head: one click away, the figures stay in view
        return f"<details><summary>The table ({len(rows):,} rows)</summary>{table}</details>"
    return table


def _figures(result) -> list:
    if isinstance(result, AdviseResult):
        return [advise.figure(result)]
    if is_result(result, TRADEOFFS):
        return tradeoffs.figures(result)
    if is_result(result, INSIDE):
        return inside_plots.figures(result)
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


def _inside(result) -> str:
    """What an Inside result says in words before its table: the scan's verdict and definitions, the grid's rule."""
    if isinstance(result, OutliersResult):
        risks = "".join(f"<li class='{'red' if r.at_risk else 'green'}'><b>{html.escape(r.spec)}</b>: "
                        f"{'at risk' if r.at_risk else 'not at risk'}, {html.escape(r.reason)}</li>"
                        for r in result.schemes if r.spec != "baseline")
        return (f"<p>{html.escape(result.model)} · {result.tokens:,} tokens of the held-out play</p>"
                f"<div class='verdict'><p class='kv-overall'>Fragility verdict</p>"
                f"<pre class='gen'>{html.escape(result.verdict)}</pre><ul>{risks}</ul></div>"
                f"<p class='env'>{html.escape(result.definition)}</p>")
    if isinstance(result, NeedleResult):
        return (f"<p>{html.escape(result.model)} · lengths {', '.join(f'{n:,}' for n in result.lengths)} tokens × "
                f"depths {', '.join(f'{d:g}' for d in result.depths)} · seed {result.seed} · "
                f"{'chat template' if result.chat else 'plain continuation'}. A cell the 16-bit cache fails is not "
                "counted against a cache (Y found, n missed, - 16-bit failed).</p>")
    if isinstance(result, AttentionShift):
        return (f"<p>{html.escape(result.model)} · layer {result.layer}, query head {result.head}, generating token "
                f"{result.step} ({html.escape(repr(result.token))}) over {result.context_tokens:,} tokens: the 16-bit "
                f"cache against {html.escape(result.spec)} ({result.sink} sink tokens and up to {result.window} "
                "newest tokens kept in 16-bit). The table lists the positions whose weight moved most.</p>")
    if isinstance(result, KeptResult):
        return (f"<p>{html.escape(result.model)} · one prompt of {result.tokens:,} tokens with a pass code at depth "
                f"{result.depth:g}: the share of each layer's KV heads that kept each position after the prompt was "
                "read, the pass code outlined.</p>")
    return (f"<p>{html.escape(result.model)} · {result.tokens:,} tokens of the held-out play. Relative error "
            "||K̂ - K|| / ||K|| of what each cache hands attention, per layer and KV head; tokens in the 16-bit "
            "window count with zero error.</p>")


def _prompt(result: CompareResult) -> str:
    """The prompt once: its tail, with the whole of it one click away."""
    text = result.prompt
    if len(text) <= PROMPT_TAIL:
        return f"<p><b>Prompt</b> ({result.prompt_tokens:,} tokens)</p><pre class='gen'>{html.escape(text)}</pre>"
    return (f"<p><b>Prompt</b> ({result.prompt_tokens:,} tokens; the last {PROMPT_TAIL} characters)</p>"
            f"<pre class='gen'>…{html.escape(text[-PROMPT_TAIL:])}</pre>"
            f"<details><summary>Show the whole prompt</summary><pre class='gen'>{html.escape(text)}</pre></details>")


def _generations(result: CompareResult) -> str:
    """Each spec's continuation (not the prompt again), the tokens that differ from the baseline marked."""
    out = [_prompt(result)]
    for run in result.caches:
        differs = set()
        for a, b in run.diff_spans:
            differs.update(range(a, b))
        text = "".join(f"<mark>{html.escape(t)}</mark>" if i in differs else html.escape(t)
                       for i, t in enumerate(run.tokens))
        out.append(f"<h4>{html.escape(run.spec)}</h4><pre class='gen'>{text}</pre>")
    return "".join(out)


def _headline(result: CompareResult) -> str:
    sentence, lines = render.headline(result)
    items = "".join(f"<li class='{t}'>{html.escape(text)}</li>" for t, text in lines)
    return (f"<div class='verdict'><p class='kv-overall'>{html.escape(sentence)}</p><ul>{items}</ul>"
            f"<p class='env'>{html.escape(render.VERDICT_FOOTNOTE)}</p></div>")


def build_report(results: list, title: str = "kvplay report") -> str:
    sections, first_plot = [], True
    opening = [_headline(r) for r in results if isinstance(r, CompareResult) and len(r.caches) > 1][:1]
    for result in results:
        parts = [f"<h2>{result.title}</h2>"]
        env = getattr(result, "env", None)
        if env is not None:
            parts.append(f"<p class='env'>{html.escape(env.model)} · {env.dtype} · {env.device} · torch "
                         f"{env.torch} · transformers {env.transformers}</p>")
        if isinstance(result, CapacityResult):
            parts.append(f"<p>{html.escape(result.arch)} on {result.gpu_gib} GiB, {result.weight_dtype} weights. "
                         f"{html.escape(result.note)}</p>")
        if is_result(result, INSIDE):
            parts.append(_inside(result))
        if isinstance(result, AdviseResult):
            parts.append(advise.answer_html(result))
        own_rows = is_result(result, INSIDE + TRADEOFFS)
        parts.append(_table(advise.table_rows(result) if isinstance(result, AdviseResult) else
                            result.summary_rows() if own_rows else tables.rows(result)))
        if isinstance(result, CompareResult):
            parts.append(_generations(result))
        for fig in filter(None, _figures(result)):       # a figure with nothing to draw is None (kvplay.show.plots)
            parts.append(fig.to_html(full_html=False, include_plotlyjs="inline" if first_plot else False,
                                     default_width="100%", config={"responsive": True}))
            first_plot = False
        sections.append("<section>" + "".join(parts) + "</section>")
    dicts = [to_dict(r) for r in results]
    data = json.dumps(dicts).replace("</", "<\\/")  # safe inside <script>
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }}
.scroll {{ overflow-x: auto; max-width: 100%; }}
table {{ border-collapse: collapse; font-size: 0.85em; margin: 1em 0; }}
.verdict {{ border: 1px solid #ddd; border-radius: 8px; padding: 0.6em 1em; }}
.kv-overall {{ font-size: 1.1em; font-weight: 600; }}
.verdict ul {{ list-style: none; padding: 0; }}
.verdict li {{ padding: 3px 8px; margin: 3px 0; border-left: 6px solid #999; }}
.verdict li.green {{ border-color: #2e9e44; background: #eef8f0; }}
.verdict li.amber {{ border-color: #e0a100; background: #fdf6e3; }}
.verdict li.red {{ border-color: #d33; background: #fdeeee; }}
.plotly-graph-div {{ max-width: 100%; }}
th, td {{ border: 1px solid #ddd; padding: 4px 8px; text-align: right; }}
th {{ background: #f4f4f4; }}
pre.gen {{ white-space: pre-wrap; overflow-wrap: anywhere; background: #fafafa; padding: 0.8em;
           border-left: 3px solid #ccc; }}
mark {{ background: #ffd6d6; }}
.env {{ color: #666; font-size: 0.85em; }}
</style></head><body>
<h1>{html.escape(title)}</h1><p class="env">Generated {stamp} by kvplay.</p>
{''.join(opening)}{''.join(sections)}
<script type="application/json" id="kvplay-data">{data}</script>
</body></html>"""


def write_report(results: list, path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(build_report(results))

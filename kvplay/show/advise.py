"""What should I deploy? in words, a table and one chart (the Deploy tab, the CLI and the report).

    sentence(result)   # "Use q8_0: 1.9x the context in a 24 GB GPU (62k instead of 32k tokens), answer kept, ..."
    risks(result)      # ["Keys at q4_0 break this model (K q4_0 / V q8_0: KL 6.7, answer lost)."]
    figure(result)     # the engine's settings on the equal-bytes chart, the recommendation outlined, kvplay's own
                       # presets faded beside them (not deployable in the engine)

Colours: each setting's identity colour (kvplay.show.style); red, amber and green belong to the verdict alone, so
the chart says "misses the bar" with a hollow marker, never a red one.
"""
from __future__ import annotations

import html

import plotly.graph_objects as go

from kvplay.cache import parse_spec
from kvplay.results import AdviseResult, DeploySetting
from kvplay.show.cards import fmt_bits, fmt_kl, tone_of
from kvplay.show.plots import LAYOUT, floored, kl_axis
from kvplay.show.style import colour_for, dash_and_marker

PRECISE = ("f16", "q8_0")          # a K or V type this precise is not what breaks a pair
NEAR_BAR = 0.8                     # a choice whose KL is this share of the bar's or more is said to sit near it


def tokens_words(n: int) -> str:
    """32k (32,768), 56k, 1.2M, 900."""
    if 1024 <= n < 1_000_000 and n % 1024 == 0:
        return f"{n // 1024}k"
    if n >= 1_000_000:
        return f"{n / 1e6:.1f}M"
    if n >= 10_000:
        return f"{n / 1000:.0f}k"
    return f"{n / 1000:.1f}k" if n >= 1000 else f"{n:,}"


def _quality(row: DeploySetting, result: AdviseResult) -> str:
    kept = "answer kept, " if result.needs_answer and row.answer_right else ""
    return f"{kept}KL {fmt_kl(row.mean_kl)}" if row.mean_kl is not None else kept.rstrip(", ")


def _measured(result: AdviseResult) -> list[DeploySetting]:
    """The engine's measured rows (kvplay's own presets left out: no engine deploys them)."""
    return [s for s in result.deployable if s.mean_kl is not None]


def own_line(result: AdviseResult) -> str:
    """What kvplay's own presets would buy, said plainly not to be this engine's: "" where none was measured."""
    ref = result.reference
    parts = [f"{s.spec} {s.context_fits / max(ref.context_fits or 1, 1):.1f}x the context ({_quality(s, result)}, "
             f"{'meets' if s.meets_bar else 'misses'} the bar)" for s in result.own
             if s.mean_kl is not None and s.context_fits]
    if not parts:
        return ""
    return (f"Not deployable in {result.engine_name}, for comparison: kvplay's own presets would buy "
            + "; ".join(parts) + ".")


def needle_words(result: AdviseResult) -> str:
    """What the needle column holds: where it was measured, or why not."""
    if not result.needle_tokens:
        return result.needle_note or "Needle not measured (asked for none)."
    ref = result.reference
    return (f"Needle: a pass code in filler at {result.needle_tokens:,} tokens (depth 0.5), asked back through each "
            "cache; " + ("16-bit finds it, so losing it misses the bar." if result.needs_needle else
                         "16-bit misses it too, so it counts against no setting." if ref.needle_found is False else
                         "not counted."))


def sentence(result: AdviseResult) -> str:
    """The answer in one sentence: the setting, what it buys against 16-bit in the budget, its quality."""
    c, ref = result.choice, result.reference
    if not ref.context_fits and not c.context_fits:
        return (f"The weights ({result.weight_gib:.1f} GiB as {result.weight_dtype}) leave no room for a cache in "
                f"{result.budget}: choose a bigger budget or smaller weights.")
    if c.spec == ref.spec:
        others = [s for s in _measured(result) if s.spec != ref.spec]
        close = min(others, key=lambda s: s.mean_kl, default=None)
        if close is None:
            why = next((_reason(s) for s in result.settings if s.status == "refused"), "")
            return f"Keep {ref.label}: this model refuses every other {result.engine_name} setting. {why}"
        return (f"Keep {ref.label}: no other {result.engine_name} setting meets the bar on {result.model} (the "
                f"closest, {close.label}: {close.verdict}).")
    limit = result.context_limit
    gain = c.context_fits / max(ref.context_fits, 1)
    if limit and ref.context_fits >= limit:
        buys = (f"{c.max_batch / max(ref.max_batch, 1):.1f}x the sequences at {tokens_words(result.context)} tokens "
                f"in {result.budget} ({c.max_batch:,} instead of {ref.max_batch:,}); one sequence reaches the "
                f"model's {tokens_words(limit)}-token limit either way")
    else:
        buys = (f"{gain:.1f}x the context in {result.budget} ({tokens_words(c.context_fits)} instead of "
                f"{tokens_words(ref.context_fits)} tokens" +
                (f", past the model's {tokens_words(limit)}-token limit)" if limit and c.context_fits > limit else ")"))
    return f"Use {c.label}: {buys}, {_quality(c, result)}."


def _reason(row: DeploySetting) -> str:
    """A refusal's sentence without the spec it starts with ("hqq-int8: transformers' quantized cache ...")."""
    return row.verdict.removeprefix(f"{row.spec}: ")


def _types(spec: str) -> tuple[str, str] | None:
    """(K type, V type) of a llama.cpp setting, None for any other."""
    parsed = parse_spec(spec)
    if not hasattr(parsed, "ctk"):
        return ("f16", "f16") if spec == "baseline" else None
    return parsed.ctk, parsed.ctv


def _breaks(row: DeploySetting) -> bool:
    return row.answer_right is False or tone_of(row.mean_kl, row.top1) == "red"


def risk_lines(result: AdviseResult) -> list[tuple[str, str]]:
    """What the settings as small as the choice or smaller do to this model, where they miss the bar: first the keys
    or the values a llama.cpp pair shows to be the culprit (the other part at f16 or q8_0), then the rest, fewest
    bits first; each with its verdict colour (red where it breaks the model, amber where it only misses the bar)."""
    c = result.choice
    failing = sorted((s for s in _measured(result) if not s.meets_bar and s.spec != c.spec and s.bits is not None
                      and c.bits is not None and s.bits <= c.bits), key=lambda s: s.bits)
    lines, blamed = [], {"K": set(), "V": set()}
    for part, mine, other in (("K", 0, 1), ("V", 1, 0)):
        for row in failing:
            kv = _types(row.spec)
            if kv and kv[other] in PRECISE and kv[mine] not in PRECISE and kv[mine] not in blamed[part]:
                blamed[part].add(kv[mine])
                lines.append((_tone(row), f"{'Keys' if part == 'K' else 'Values'} at {kv[mine]} "
                                          f"{'break' if _breaks(row) else 'miss the bar on'} this model ({row.label}: "
                                          f"{row.verdict})."))
    if c.mean_kl is not None and c.spec != result.reference.spec and c.mean_kl >= NEAR_BAR * result.max_kl:
        lines.insert(0, ("amber", f"{c.label} sits near the bar: KL {c.mean_kl:.3g} against {result.max_kl:g}, on "
                                  f"{result.text_tokens} tokens of text; another text may put it over."))
    for row in failing:
        kv = _types(row.spec)
        if not kv or (kv[0] not in blamed["K"] and kv[1] not in blamed["V"]):
            lines.append((_tone(row), f"{row.label} {'breaks' if _breaks(row) else 'misses the bar on'} this model: "
                                      f"{row.verdict}."))
    return lines[:4]


def _tone(row: DeploySetting) -> str:
    return "red" if _breaks(row) else "amber"


def risks(result: AdviseResult) -> list[str]:
    """risk_lines' words."""
    return [words for _, words in risk_lines(result)]


def scope(result: AdviseResult) -> str:
    """Where the answer comes from: recorded or live, the measured model (a sibling where the bytes are projected)."""
    where = (f"Recorded {result.recorded}; press Advise to measure it here." if result.recorded else
             f"Measured {result.measured}" + (f"; {result.cached} settings read from earlier measurements" if
                                               result.cached else "") + f"; answered in {result.seconds:.2f} s.")
    if result.projected:
        where = f"{result.arch}'s bytes, measured on the {result.size} sibling ({result.model}). " + where
    return where


def text(result: AdviseResult) -> str:
    """The answer for a terminal: the sentence, the line to paste, the risks, the caveats with their sources."""
    out = [sentence(result), "", f"  {result.paste}", ""]
    out += risks(result)
    chosen = set(result.choice.caveats)
    out += [f"Speed and setup: {c.text} ({c.source})" for c in result.caveats if c.key in chosen]
    out += [line for line in (own_line(result), needle_words(result)) if line]
    out += ["", f"Bar ({result.bar}): {_bar_words(result)}. " + scope(result)] + result.notes
    return "\n".join(out)


def _bar_words(result: AdviseResult) -> str:
    parts = (["answer kept"] if result.needs_answer else []) + (["needle found"] if result.needs_needle else []) \
        + [f"mean KL at most {result.max_kl:g}"]
    if result.min_top1 is not None:
        parts.append(f"top-1 at least {100 * result.min_top1:.0f}%")
    return " and ".join(parts)


def answer_html(result: AdviseResult) -> str:
    """The first screen: the sentence, the line to paste, the risks (verdict lines), caveats linked to sources."""
    e = html.escape
    risk = "".join(f"<li class='kv-verdict-line {tone}'>{e(line)}</li>" for tone, line in risk_lines(result))
    chosen = set(result.choice.caveats)
    caveats = "".join(f"<li>{e(c.text)} <a href='{e(c.source)}' target='_blank' rel='noopener'>source</a></li>"
                      for c in result.caveats if c.key in chosen)
    return (f"<div class='kv-verdict kv-deploy'><p class='kv-overall'>{e(sentence(result))}</p>"
            f"<pre class='kv-paste'><code>{e(result.paste)}</code></pre>"
            + (f"<ul>{risk}</ul>" if risk else "")
            + (f"<p class='kv-foot'>Speed and setup the engine does not print:</p><ul class='kv-caveats'>{caveats}"
               "</ul>" if caveats else "")
            + "".join(f"<p class='kv-foot kv-{cls}'>{e(line)}</p>" for cls, line in (
                ("own", own_line(result)), ("needle", needle_words(result))) if line)
            + f"<p class='kv-foot'>Bar: {e(_bar_words(result))}. {e(scope(result))}</p></div>")


def table_rows(result: AdviseResult) -> list[dict]:
    """The evidence, one row a setting: its bytes in the budget, its quality, its flag."""
    batch = f"Max batch at {tokens_words(result.context)}"
    needle = f"Needle at {tokens_words(result.needle_tokens)}" if result.needle_tokens else "Needle"
    rows = []
    for s in result.settings:
        measured = s.mean_kl is not None
        answer = "-" if s.answer is None else f"{s.answer} {'✓' if s.answer_right else '✗'}"
        found = ("not measured" if not result.needle_tokens or s.needle_found is None else
                 f"{s.needle or '(nothing)'} {'✓' if s.needle_found else '✗'}")
        real = " [the real llama.cpp]" if s.source != "kvplay" else ""
        rows.append({"Setting": ("➜ " if s.spec == result.recommended else "") + s.label + real,
                     "Bits": fmt_bits(s.bits) if s.bits is not None else "-",
                     "Context that fits": f"{s.context_fits:,}" if s.context_fits is not None else "-",
                     batch: f"{s.max_batch:,}" if s.max_batch is not None else "-",
                     "KL (nats)": fmt_kl(s.mean_kl) if measured else "-",
                     "Top-1 (%)": f"{100 * s.top1:.1f}" if measured else "-",
                     "Answer": answer if measured else "not measured",
                     needle: found if measured else "not measured",
                     "Meets the bar": ("yes" if s.meets_bar else "no") if measured else "-",
                     "Why": s.verdict, "Engine flag": s.flag})
    return rows


def figure(result: AdviseResult) -> go.Figure:
    """The engine's measured settings on the equal-bytes chart: bits per element against mean KL, one colour per
    setting, hollow where it misses the bar, the recommendation outlined, the bar's KL a dotted line; kvplay's own
    presets faded beside them, labelled as not deployable in the engine."""
    shown = [s for s in _measured(result) if s.bits is not None]
    own = [s for s in result.own if s.mean_kl is not None and s.bits is not None]
    fig = go.Figure()
    fig.update_layout(**{**LAYOUT, "title": {**LAYOUT["title"], "text": (
        f"Quality against bytes: {result.engine_name}'s settings<br><sup>{result.model}, KL over "
        f"{result.text_tokens} tokens of text</sup>")}},
        xaxis_title="bits per cached element (K and V)", yaxis_title="mean KL to 16-bit (nats)")
    floor = kl_axis(fig, [s.mean_kl for s in shown + own] + [result.max_kl])
    for s in shown + own:
        _, symbol = dash_and_marker(s.spec)
        chosen = s.spec == result.recommended
        label = s.label if s.deployable else f"{s.spec} (kvplay's own)"
        fig.add_trace(go.Scatter(
            x=[s.bits], y=floored([s.mean_kl], floor), mode="markers+text", name=label, text=[label],
            textposition="top center" if s.deployable else "bottom center", textfont=dict(size=10),
            cliponaxis=False, opacity=1.0 if s.deployable else 0.45,
            marker=dict(color=colour_for(s.spec), symbol=symbol if s.meets_bar else f"{symbol}-open",
                        size=18 if chosen else 11, line=dict(color="black", width=3 if chosen else 0)),
            hovertemplate=(f"{html.escape(s.label)}<br>%{{x:.2f}} bits/element<br>KL {fmt_kl(s.mean_kl)}, top-1 "
                           f"{100 * s.top1:.0f}%<br>{html.escape(s.verdict)}<extra></extra>")))
    keys = [("misses the bar (hollow)", "circle-open", 0, 1.0), ("the one to deploy (outlined)", "circle", 3, 1.0)]
    if own:
        keys.append((f"kvplay's own (faded): not deployable in {result.engine_name}", "circle", 0, 0.45))
    for name, symbol, width, opacity in keys:
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name, hoverinfo="skip", opacity=opacity,
                                 marker=dict(color="#9a9a9a", symbol=symbol, size=11,
                                             line=dict(color="black", width=width))))
    if shown:
        xs = [s.bits for s in shown + own]
        fig.add_trace(go.Scatter(x=[min(xs) - 0.5, max(xs) + 0.5], y=[result.max_kl] * 2, mode="lines",
                                 name=f"the bar: KL {result.max_kl:g}", hoverinfo="skip",
                                 line=dict(color="#555555", dash="dot", width=1)))
    return fig


# ---------------------------------------------------------------------------- docs/deploy.md's evidence

DOCS_START = "<!-- recorded answers: written by scripts/record_deploy.py from assets/recorded/deploy/; do not edit -->"
DOCS_END = "<!-- end of recorded answers -->"


def markdown(result: AdviseResult) -> str:
    """One recorded answer for docs/deploy.md: the sentence, the line to paste, the risks, the measured rows."""
    cell = lambda v: str(v).replace("|", "\\|")             # noqa: E731
    lines = [f"**{result.engine_name}**: {sentence(result)}", "", f"    {result.paste}", ""]
    lines += [f"- {r}" for r in risks(result)] + ([""] if risks(result) else [])
    lines += [f"| setting | bits | context that fits in {result.budget} | max batch at {tokens_words(result.context)} "
              "| KL | top-1 | answer | meets the bar | flag |", "|---|---|---|---|---|---|---|---|---|"]
    for row in table_rows(result):
        if row["KL (nats)"] == "-" and row["Answer"] == "not measured":
            continue
        values = [v for k, v in row.items() if k not in ("Why", "Engine flag") and not k.startswith("Needle")]
        lines.append("| " + " | ".join(cell(v) for v in values) + f" | `{cell(row['Engine flag'])}` |")
    pruned = sum(s.status == "pruned" for s in result.settings)
    refused = [s for s in result.settings if s.status == "refused"]
    if pruned:
        lines.append(f"\n{pruned} more pairs not measured: the measured ones settle them (pruned by the rule).")
    for why in dict.fromkeys(_reason(s) for s in refused):
        lines.append(f"\nNot run on this model: {', '.join(s.label for s in refused if _reason(s) == why)}: {why}")
    lines.append(f"\nRecorded {result.recorded}: {result.text_tokens} tokens of {result.text_name}, chunk "
                 f"{result.chunk}, and \"{result.task}\"; {result.weight_dtype} weights.")
    return "\n".join(lines)


def _same_evidence(result: AdviseResult, answers: list[AdviseResult]) -> AdviseResult | None:
    """The answer already shown whose measured rows are this one's (LM Studio's are llama.cpp's), if any."""
    mine = [(s.spec, s.mean_kl) for s in _measured(result)]
    earlier = answers[:next(i for i, a in enumerate(answers) if a is result)]
    return next((a for a in earlier if [(s.spec, s.mean_kl) for s in _measured(a)] == mine), None)


def docs_section(results: dict[str, list[AdviseResult]]) -> str:
    """docs/deploy.md's recorded section: per model (name -> its recorded answers), a heading, then each engine's
    answer; an engine whose evidence another's table already shows (LM Studio: llama.cpp's) gets its sentence and
    line to paste only."""
    engines = list(dict.fromkeys(a.engine_name for answers in results.values() for a in answers))
    summary = ["The answers at a glance (the setting to deploy, its KL and its size against 16-bit's):", "",
               "| model | " + " | ".join(engines) + " |", "|---" * (len(engines) + 1) + "|"]
    for model, answers in results.items():
        cells = {a.engine_name: f"{a.choice.label} (KL {fmt_kl(a.choice.mean_kl or 0)}, "
                                f"{16 / a.choice.bits:.1f}x)" if a.choice.bits else "-" for a in answers}
        summary.append(f"| {model} | " + " | ".join(cells.get(e, "-") for e in engines) + " |")
    parts = ["\n".join(summary)]
    for model, answers in results.items():
        shown = []
        for r in answers:
            same = _same_evidence(r, answers)
            shown.append(markdown(r) if same is None else (
                f"**{r.engine_name}**: {sentence(r)}\n\n    {r.paste}\n\nThe same measurements as {same.engine_name}'s "
                "above, the engine's own words for each setting."))
        parts.append(f"### {model}\n\n" + "\n\n".join(shown))
    return "\n".join([DOCS_START, "\n\n".join(parts), DOCS_END])

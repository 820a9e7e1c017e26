"""HTML and code snippets for the UI and the report: results in, strings out (no torch)."""
from __future__ import annotations

import html

from .cache.spec import defaults, parse_spec
from .plots import colour_for
from .results import CacheRun, CompareResult


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def snippet(spec_text: str, max_new_tokens: int = 64) -> str:
    """Python that reproduces this cache in the user's own code."""
    spec = parse_spec(spec_text)
    head = "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
    load = ('tok = AutoTokenizer.from_pretrained(MODEL)\nmodel = AutoModelForCausalLM.from_pretrained(MODEL)\n'
            'inputs = tok(PROMPT, return_tensors="pt")\n')
    if spec.backend == "dynamic":
        return head + load + f"out = model.generate(**inputs, max_new_tokens={max_new_tokens}, do_sample=False)\n"
    if spec.backend in ("quanto", "hqq"):
        config = {"backend": spec.backend, "nbits": spec.scheme.bits, "q_group_size": spec.group,
                  "residual_length": spec.residual, "axis_key": spec.axis_key, "axis_value": spec.axis_value}
        note = ("# kvplay pads HQQ's groups so any batch or length packs; plain HQQ may need counts divisible by 4\n"
                if spec.backend == "hqq" else "")
        return (head + load + note + f"out = model.generate(**inputs, max_new_tokens={max_new_tokens}, do_sample=False,\n"
                f"                     cache_implementation=\"quantized\",\n                     cache_config={config!r})\n")
    return (head + "from kvplay.cache import build_cache\n\n" + load +
            f"cache = build_cache({str(spec)!r}, model)  # a transformers Cache\n"
            f"out = model.generate(**inputs, max_new_tokens={max_new_tokens}, do_sample=False, past_key_values=cache)\n")


def _badge(label: str, value: str, tone: str = "") -> str:
    return f"<span class='kv-badge {tone}'><b>{html.escape(value)}</b> {html.escape(label)}</span>"


def _highlighted(run: CacheRun) -> str:
    differs = set()
    for a, b in run.diff_spans:
        differs.update(range(a, b))
    return "".join(f"<mark title='differs from 16-bit'>{html.escape(t)}</mark>" if i in differs else html.escape(t)
                   for i, t in enumerate(run.tokens))


def card(run: CacheRun, result: CompareResult) -> str:
    base = run.spec == "baseline"
    div = ("identical to 16-bit" if run.first_divergence is None
           else f"departs at token {run.first_divergence}")
    badges = [_badge("cache", human_bytes(run.cache_bytes)),
              _badge("smaller", f"{run.compression:.2f}x", "good" if run.compression > 1.5 else ""),
              _badge("tok/s", f"{run.decode_tokens_per_s:.1f}")]
    if not base:
        badges += [_badge("", div, "good" if run.first_divergence is None else "warn"),
                   _badge("top-1 agreement", f"{100 * run.top1_agreement:.0f}%",
                          "good" if run.top1_agreement > 0.95 else "warn"),
                   _badge("mean KL", f"{run.mean_kl:.4f}")]
    tail = result.prompt[-160:]
    return f"""<div class='kv-card' style='border-top: 4px solid {colour_for(run.spec)}'>
<div class='kv-title'>{html.escape(run.spec)}{' <small>(reference)</small>' if base else ''}</div>
<div class='kv-badges'>{''.join(badges)}</div>
<div class='kv-text'><span class='kv-prompt'>…{html.escape(tail)}</span>{_highlighted(run)}</div>
<div class='kv-desc'>{html.escape(run.description)}</div></div>"""


CARD_CSS = """
.kv-cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(320px, 1fr)); gap: 12px; }
.kv-card { border: 1px solid #ddd; border-radius: 8px; padding: 10px 12px; background: #fff; color: #222; }
.kv-title { font-weight: 600; font-family: monospace; margin-bottom: 6px; }
.kv-badge { display: inline-block; font-size: 0.78em; padding: 2px 6px; margin: 0 4px 4px 0; border-radius: 10px;
            background: #eef1f5; }
.kv-badge.good { background: #e3f6e8; } .kv-badge.warn { background: #fdeaea; }
.kv-text { white-space: pre-wrap; font-family: Georgia, serif; font-size: 0.92em; max-height: 320px; overflow-y: auto;
           border-left: 3px solid #eee; padding-left: 8px; margin-top: 6px; }
.kv-prompt { color: #999; }
.kv-text mark { background: #ffd0d0; color: inherit; border-radius: 2px; }
.kv-desc { color: #777; font-size: 0.78em; margin-top: 6px; }
"""


def cards_html(result: CompareResult) -> str:
    return "<div class='kv-cards'>" + "".join(card(r, result) for r in result.caches) + "</div>"


def snippets_markdown(result: CompareResult) -> str:
    return "\n".join(f"**{r.spec}**\n```python\n{snippet(r.spec, result.max_new_tokens)}```\n" for r in result.caches)


def spec_with_overrides(name: str, overrides: dict) -> str:
    """A preset plus the Advanced options that apply to its backend; empty/None values keep the default."""
    from .cache.spec import OPTIONS

    base = defaults(name)
    opts = {k: v for k, v in overrides.items()
            if v not in (None, "", "default") and k in OPTIONS[base.backend] and getattr(base, k) is not None}
    return name + (":" + ",".join(f"{k}={v}" for k, v in opts.items()) if opts else "")

"""One palette for every tab: a cache's identity colour, the verdict's colours, and the heatmaps' scale.

Colour means one thing. Green, amber and red belong to the verdict alone (VERDICT: the verdict lines and the
verdict badge on a card). A cache's identity colour (its card's top border, its lines, bars and points in every
plot of every tab and of the HTML report) comes from the colour family its method declares
(CacheMethod.colour_family in kvplay/cache/methods/), and no family holds a red, green or amber hue: the 16-bit
baseline's method declares grey, quanto blue, HQQ cyan, kvplay's engine purple. Each scheme takes the shade at
its place in its method's `schemes`, so kvplay-int4 and kvplay-int2 are two different purples in every figure;
a variant with options ("kvplay-int2:group=16") keeps its scheme's colour and draws a long dash. A method that
declares no family takes a spare one (indigo, magenta or slate) by its name, and a spec no registered method
knows (a stored result) a spare shade by its text. Line dash and marker symbol come from the method too; nothing
here looks at a backend's name. verdict_like() is the test every identity colour passes.

Every function takes what a result carries: a CacheRun or its CacheLabel (the scheme and whether it is a variant,
resolved where the run was made), a parsed CacheSpec, or a spec's text, which kvplay.cache's parser reads; nothing
here splits a spec on ":".

    colour_for("kvplay-int2")   # '#b2459f'
    colour_for(run)             # a Compare's CacheRun: its label's scheme
    style_for("quanto-int4")    # {'line': {...}, 'marker': {...}} for plotly
"""
from __future__ import annotations

import colorsys
import zlib

from kvplay.cache import METHODS, SCHEMES, CacheSpec, parse_spec
from kvplay.errors import KvplayError
from kvplay.results.compare import CacheLabel

VERDICT = {"green": "#2e9e44", "amber": "#e0a100", "red": "#d33333"}   # the verdict's colours, nothing else's
BASELINE_GREY = "#6e6e6e"
# Shades per family, darkest first where a method has few schemes; hues 190-320 (cyan to magenta) and grey only.
FAMILIES = {
    "grey": (BASELINE_GREY, "#9a9a9a", "#4a4a4a"),
    "blue": ("#1f5bb5", "#74a6e8", "#0d3575", "#4a7bd1"),
    "cyan": ("#0a6f8c", "#1ba2c6", "#6cc4de", "#06475a"),
    "purple": ("#3b2277", "#6a3d9a", "#9a86d6", "#b2459f", "#7a5ab8", "#52307f", "#8c6bb1", "#c39bd3"),
    "indigo": ("#3949ab", "#7986cb", "#232f7a", "#5c6bc0", "#a3aee0", "#151d57"),
    "magenta": ("#8e1a6e", "#cc5fae", "#5f0f49", "#b03a8e", "#e39ccd", "#3f0a31",
                "#d24fa6", "#7d3a6f", "#f0c2e2", "#b86aa8"),     # vLLM's: fp8, nvfp4, per-token-head, TurboQuant
    "slate": ("#3c5a80", "#7f9cc0", "#24374f", "#5a7aa3", "#a9bed8", "#162232"),
}
SPARE_FAMILIES = ("indigo", "magenta", "slate")      # for methods that declare none, by the method's name
# The equal-bytes chart of both levers colours points by lever, each a family's first shade (never a verdict hue).
LEVER_COLOURS = {"16-bit": BASELINE_GREY, "quantized": FAMILIES["purple"][1], "evicted": FAMILIES["cyan"][1],
                 "both": FAMILIES["magenta"][0]}
HEATMAP = "Blues"             # sequential scale for magnitudes (error, outlier ratios): no verdict hue
SINK_SHADE = "#7f7f7f"        # shaded regions of the attention plot: 16-bit sink tokens
WINDOW_SHADE = "#5b7fbf"      # and the 16-bit window
DEFAULT_DASH, DEFAULT_MARKER = "dashdot", "triangle-up"
NAMED = {"black": "#000000", "white": "#ffffff", "grey": "#808080", "gray": "#808080"}


def resolved(spec) -> tuple[str, bool]:
    """(its registered scheme's name, whether its options differ from the scheme's preset) from a CacheRun, its
    CacheLabel, a CacheSpec or a spec's text (parsed by kvplay.cache); a text no registered method knows is its
    own name, no variant."""
    label = getattr(spec, "label", spec)
    if isinstance(label, CacheLabel) and label.scheme:
        return label.scheme, label.variant
    if not isinstance(spec, CacheSpec):
        text = str(getattr(spec, "spec", spec))
        try:
            spec = parse_spec(text)
        except KvplayError:
            return text.strip(), False
    return spec.name, str(spec) != spec.name


def scheme_of(spec) -> str:
    """'kvplay-int2' from 'kvplay-int2:group=16' (or from its run, label or parsed spec)."""
    return resolved(spec)[0]


def _scheme(name: str):
    """The registered Scheme of this name, or None (a stored result from a method no longer registered)."""
    return SCHEMES.get(name)


SPARE = tuple(c for f in SPARE_FAMILIES for c in FAMILIES[f])


def _spare(name: str) -> str:
    return SPARE[zlib.crc32(name.encode()) % len(SPARE)]


def _family(method) -> tuple[str, ...]:
    """The method's declared family, or a spare family by its name."""
    declared = FAMILIES.get(getattr(method, "colour_family", None) or "")
    return declared or FAMILIES[SPARE_FAMILIES[zlib.crc32(method.name.encode()) % len(SPARE_FAMILIES)]]


def colour_for(spec) -> str:
    """A scheme's identity colour in every tab: its method's family, the shade at the scheme's place (a spec
    no registered method knows takes a spare shade by its name)."""
    name = scheme_of(spec)
    scheme = _scheme(name)
    if scheme is None or scheme.method is None:
        return _spare(name)
    shades = _family(scheme.method)
    index = next((i for i, s in enumerate(scheme.method.schemes) if s.name == name), 0)
    return shades[(index + scheme.method.colour_offset) % len(shades)]


def method_colour(method_name: str) -> str:
    """A method's own colour (its first shade), for charts that group points by method."""
    method = METHODS.get(method_name)
    return _family(method)[0] if method is not None else _spare(method_name)


def dash_and_marker(spec) -> tuple[str, str]:
    scheme = _scheme(scheme_of(spec))
    method = scheme.method if scheme is not None else None
    return (getattr(method, "line_dash", DEFAULT_DASH), getattr(method, "marker", DEFAULT_MARKER))


def marker_for_method(method_name: str) -> str:
    return getattr(METHODS.get(method_name), "marker", DEFAULT_MARKER)


def style_for(spec) -> dict:
    """plotly line and marker for a spec: its colour, its method's dash (a variant: long dash) and marker."""
    dash, symbol = dash_and_marker(spec)
    name, variant = resolved(spec)
    if variant:
        dash = "longdash"
    scheme = _scheme(name)
    reference = scheme is not None and scheme.method is not None and not scheme.method.quantized
    colour = colour_for(spec)
    return dict(line=dict(color=colour, dash=dash, width=3 if reference else 2),
                marker=dict(color=colour, symbol=symbol, size=7))


def verdict_like(colour: str) -> bool:
    """Whether a colour reads as one of the verdict's: a clearly saturated red, orange, amber, yellow or green.

    Accepts '#rrggbb', '#rgb', 'rgb(r, g, b)' / 'rgba(...)' (what a browser reports) and black, white, grey.
    Greys and hues from cyan to magenta pass.
    """
    text = NAMED.get(colour.strip().lower(), colour.strip().lower())
    if text.startswith("#") and len(text) == 4:                 # '#333'
        text = "#" + "".join(c * 2 for c in text[1:])
    if text.startswith("#"):
        r, g, b = (int(text[i:i + 2], 16) for i in (1, 3, 5))
    elif text.startswith("rgb"):
        r, g, b = (int(float(v)) for v in text[text.index("(") + 1:text.index(")")].split(",")[:3])
    else:
        raise ValueError(f"verdict_like reads '#rrggbb', '#rgb' or 'rgb(r, g, b)', not {colour!r}.")
    hue, light, sat = colorsys.rgb_to_hls(r / 255, g / 255, b / 255)
    if sat < 0.25 or light < 0.12 or light > 0.93:
        return False
    return not 175 <= hue * 360 <= 330


# The cards' and the verdict's styles (the Compare tab and the report).
CARD_CSS = """
.kv-verdict { border: 1px solid #ddd; border-radius: 8px; padding: 10px 14px; background: #fff; color: #222; }
.kv-overall { font-size: 1.08em; font-weight: 600; margin: 0 0 6px 0; }
.kv-verdict ul { list-style: none !important; padding: 0 !important; margin: 0 !important; }
.kv-verdict li { list-style: none !important; } .kv-verdict li::marker { content: none; }
.kv-verdict-line { padding: 3px 8px; margin: 3px 0; border-left: 6px solid #999; border-radius: 3px; }
.kv-verdict-line.green { border-color: VERDICT_GREEN; background: #eef8f0; }
.kv-verdict-line.amber { border-color: VERDICT_AMBER; background: #fdf6e3; }
.kv-verdict-line.red { border-color: VERDICT_RED; background: #fdeeee; }
.kv-verdict-line.pending { border-color: #b0b0b0; background: #f4f4f4; color: #555; }
.kv-verdict-line.ref { border-color: #888; color: #555; }
.kv-verdict-line.refused { border-color: #b0b0b0; border-left-style: dashed; color: #555; }
.kv-foot, .kv-legend { color: #666; font-size: 0.8em; margin: 6px 0 0 0; }
.kv-cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(300px, 1fr)); gap: 12px; }
.kv-card { border: 1px solid #ddd; border-radius: 8px; padding: 10px 12px; background: #fff; color: #222; }
.kv-title { font-weight: 600; font-family: monospace; margin-bottom: 6px; }
.kv-badge { display: inline-block; font-size: 0.78em; padding: 2px 6px; margin: 0 4px 4px 0; border-radius: 10px;
            background: #eef1f5; }
.kv-badge.green { background: #e3f6e8; } .kv-badge.red { background: #fdeaea; }
.kv-badge.amber { background: #fdf3d6; } .kv-badge.pending, .kv-badge.refused { background: #eeeeee; color: #555; }
.kv-text { white-space: pre-wrap; font-family: Georgia, serif; font-size: 0.92em; border-left: 3px solid #eee;
           padding-left: 8px; margin-top: 6px; overflow-wrap: anywhere; }
.kv-prompt { color: #999; }
.kv-answer { border-top: 1px dashed #bbb; margin-top: 4px; padding-top: 4px; }
.kv-label { font: 600 0.72em system-ui, sans-serif; text-transform: uppercase; letter-spacing: .04em; color: #888;
            margin-right: 6px; }
.kv-task { font: 600 0.95em ui-monospace, monospace; margin: 2px 0 4px 0; }
.kv-tok { position: relative; border-radius: 2px; cursor: help; }
.kv-tok.diff { border-bottom: 2px solid #d33; }
.kv-tok:hover, .kv-tok:focus { outline: 1px solid #555; }
.kv-tip { display: none; position: absolute; z-index: 50; left: 0; top: 1.4em; width: max-content;
          max-width: min(420px, 86vw);
          background: #fff; color: #222; border: 1px solid #999; border-radius: 6px; padding: 6px 8px;
          font: 12px/1.35 system-ui, sans-serif; white-space: normal; box-shadow: 0 2px 8px rgba(0,0,0,.2); }
.kv-tok:hover .kv-tip, .kv-tok:focus .kv-tip { display: block; }
.kv-tip p { margin: 2px 0; color: #666; }
.kv-lists { display: flex; gap: 12px; }
.kv-tip ol { margin: 2px 0 0 0; padding-left: 1.4em; }
.kv-tip li.chosen { font-weight: 700; }
.kv-tip code { background: #eef1f5; padding: 0 3px; border-radius: 3px; font-size: 12px; }
.kv-desc { color: #777; font-size: 0.78em; margin-top: 6px; }
/* a phone: a tapped token's top-5s at the foot of the screen, whole, wherever the token sits in its line */
@media (max-width: 640px) {
  .kv-tip { position: fixed; left: 8px; right: 8px; top: auto; bottom: 8px; width: auto; max-width: none; }
}
""".replace("VERDICT_GREEN", VERDICT["green"]).replace("VERDICT_AMBER", VERDICT["amber"]).replace(
    "VERDICT_RED", VERDICT["red"])     # the verdict's colours, from VERDICT above

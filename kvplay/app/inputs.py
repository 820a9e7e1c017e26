"""Compare's inputs, declared once: what the page's components, the handler's signature, the share link, the
gradio_client API (`/compare`) and `python -m kvplay compare`'s flags are all made from.

    for i in compare_inputs():           # in the API's order
        i.name, i.default, i.label, i.info, i.kind, i.flag

The fixed inputs come first, in the order the API has always had (a positional gradio_client call keeps
working); every option of every registered cache method (kvplay.cache.advanced_options) is an input too, an
"Advanced" one, so a method registered with a new option reaches the page, the API and the CLI with no other
edit. compare_specs turns the inputs into the run's CacheSpecs, once, at the edge.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvplay.cache import DEFAULT_SPECS, METHODS, SCHEMES, CacheSpec, advanced_options, parse_spec
from kvplay.cache.methods import OptionSpec
from kvplay.errors import KvplayError

__all__ = ["Input", "FIRST_OPTIONS", "DEFAULT", "compare_inputs", "advanced_inputs", "compare_specs", "cli_specs",
           "option_values"]

DEFAULT = "default"        # an Advanced input left alone: each cache keeps its own value
# The Advanced options the API took from its first version, in their places between extra_specs and weights;
# every other option follows chat, in registry order, so that positional calls made before keep their meaning.
FIRST_OPTIONS = ("group", "residual", "keys", "values", "rotation", "sink", "kbits", "vbits")
_OPTION_VALUE = re.compile(r"^[\w.\-]{1,16}$")


@dataclass(frozen=True)
class Input:
    """One input of Compare.

    name: the handler's argument, the API's parameter and the share link's key.
    default: what the handler takes when a caller leaves the input out.
    kind: "text", "int", "bool", "specs" (cache names), "choice" or "option" (a cache method's option, whose
    value is DEFAULT or one of `choices`, or a number typed in when `numeric`).
    flag: the CLI flag, or None where the CLI has no such flag of its own (kvplay.cli.common's shared flags).
    """

    name: str
    default: Any
    label: str
    info: str = ""
    kind: str = "text"
    choices: tuple = ()
    numeric: bool = False
    flag: str | None = None
    option: OptionSpec | None = None

    @property
    def advanced(self) -> bool:
        return self.option is not None


def _fixed() -> list[Input]:
    return [
        Input("model", None, "Model", kind="text"),                                 # --model: a shared flag
        Input("prompt", "", "Prompt", flag="--prompt",
              info="prompt text (default: the model's default task)"),
        Input("max_new_tokens", 64, "Max new tokens", kind="int", flag="--max-new-tokens"),
        Input("caches", None, "Caches to compare (16-bit baseline always runs)", kind="specs"),   # --caches: shared
        Input("extra_specs", "", "Extra specs", info="Space-separated spec strings; see About for the syntax."),
        Input("weights", "none", "Weight quantization (quanto)", kind="choice", choices=("none", "int8", "int4")),
        Input("batch_size", 1, "Batch size", kind="int", flag="--batch-size"),
        Input("chat", None, "Chat template", kind="bool", flag="--chat",
              info="Wrap the prompt in the model's chat template (on for chat models)."),
    ]


def _takers(name: str) -> list[str]:
    return [m.name for m in METHODS.values() if any(o.name == name for o in m.option_specs())]


def advanced_inputs() -> list[Input]:
    """An input per option of the registered cache methods, first declaration first (read from the registry when
    called, so a method registered before the page or the parser is built is in it)."""
    out = []
    for name, o in advanced_options().items():
        values = o.choices or o.grid or (o.default,)
        numeric = o.kind is not str
        first = o.label.split(" ", 1)[0]
        label = o.label[:1].upper() + o.label[1:] if first.isalpha() else o.label     # "fp8 scales" stays
        out.append(Input(name, DEFAULT, label, info=f"{', '.join(_takers(name))}: {o.help}",
                         kind="option", choices=(DEFAULT, *values), numeric=numeric,
                         flag="--" + name.replace("_", "-"), option=o))
    return out


def compare_inputs() -> list[Input]:
    """Every input of Compare in the API's order: model, prompt, max_new_tokens, caches, extra_specs, the
    first Advanced options, weights, batch_size, chat, then every other option."""
    fixed = {i.name: i for i in _fixed()}
    options = {i.name: i for i in advanced_inputs()}
    clash = sorted(set(fixed) & set(options))
    if clash:
        raise KvplayError(f"A cache method's option {clash[0]!r} has the name of one of Compare's inputs; rename it.")
    first = [options.pop(n) for n in FIRST_OPTIONS if n in options]
    return [fixed["model"], fixed["prompt"], fixed["max_new_tokens"], fixed["caches"], fixed["extra_specs"], *first,
            fixed["weights"], fixed["batch_size"], fixed["chat"], *options.values()]


def option_values(values: dict) -> dict:
    """The Advanced inputs among `values`, as spec option values: whole numbers as ints, anything else one short
    word; None, "" and DEFAULT keep each cache's own value (and are left out)."""
    out = {}
    for i in advanced_inputs():
        v = values.get(i.name)
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, str):
            v = v.strip()
            v = int(v) if v.isdigit() else v
        if v in (None, "", DEFAULT):
            continue
        if not _OPTION_VALUE.match(str(v)):
            raise KvplayError(f"Option {i.name}={str(v)[:20]!r} is invalid; give a number or a single word.")
        out[i.name] = v
    return out


def _preset_names(caches) -> list[str]:
    if isinstance(caches, str):
        caches = caches.split()
    if not isinstance(caches, (list, tuple)):
        raise KvplayError("Caches to compare must be a list of cache names.")
    for name in caches:
        if not (isinstance(name, str) and name in SCHEMES):
            parse_spec(name)  # the registry's own sentence for an unknown name
            raise KvplayError(f"{name!r} is not a preset name; put specs with options under Extra specs.")
    return list(caches)


def _named_options(text: str) -> set[str]:
    """The options a spec string names itself ("kvplay-int2:group=16" names group)."""
    return {item.split("=", 1)[0].strip().lower() for item in text.partition(":")[2].split(",") if "=" in item}


def compare_specs(caches=None, extra_specs: str = "", options: dict | None = None,
                  max_specs: int | None = None) -> list[CacheSpec]:
    """The run's specs, each parsed once: the presets ticked (`caches`, cache names; None: the default presets)
    with the Advanced `options` applied to each that takes them, then the `extra_specs` as written. The 16-bit
    baseline leads when an option applies to it (the app adds a plain one otherwise). More than 4 x `max_specs`
    are refused before any is parsed, with the sentence kvplay.app.checks.parse_specs gives for too many."""
    if extra_specs is not None and not isinstance(extra_specs, str):
        raise KvplayError("Extra specs must be text.")
    opts = options or {}
    chosen = _preset_names(caches) if caches is not None else list(DEFAULT_SPECS)
    words = (extra_specs or "").split()
    if max_specs is not None and len(chosen) + len(words) > 4 * max_specs:
        raise KvplayError(f"At most {max_specs} cache specs per run, got {len(chosen) + len(words)}.")
    base = CacheSpec("baseline").with_options(**opts)
    lead = [base] if str(base) != "baseline" else []
    extra = [parse_spec(s) for s in words]
    return lead + [parse_spec(name).with_options(**opts) for name in chosen] + extra


def cli_specs(caches, options: dict | None = None) -> list[CacheSpec]:
    """The CLI's --caches, each parsed once, with the Advanced flags applied to each spec that takes them and does
    not name them itself (`--caches kvplay-int2:group=16 --group 32` keeps 16)."""
    opts = options or {}
    out = []
    for text in caches:
        named = _named_options(text)
        out.append(parse_spec(text).with_options(**{k: v for k, v in opts.items() if k not in named}))
    base = CacheSpec("baseline").with_options(**opts)
    return ([base] if str(base) != "baseline" and not any(str(s).startswith("baseline") for s in out) else []) + out

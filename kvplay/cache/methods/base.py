"""The interface a cache method implements, modelled on kvpress's BasePress, and the registry.

A method is one object that owns everything kvplay does with one kind of KV cache:

    Options            a frozen dataclass; each field declared with option(): default, valid values, help
    schemes            the named presets it offers ("kvplay-int4"), each a Scheme with its option values
    check()            refuses, before a run, a spec this model cannot take
    build()            the transformers Cache object for model.generate(past_key_values=...)
    layer_types        the cache layer classes it creates; layer_nbytes() counts their exact bytes and
                       dequantized_kv() reads back what attention gets from them
    analytic_nbytes()  the bytes its formula predicts
    snippet()          Python that reproduces the cache in a user's own code
    description        one line for the UI, the CLI help and the docs
    engine, runner     where its caches run, and the lab module that runs them when that is not transformers
    colour_family      its colour in every tab (kvplay.show.style), with line_dash and marker

register(method) puts it in the registry below. The spec parser, the UI's presets and Advanced
controls, the CLI help, the docs tables and the test matrix all read the registry, so a new
method is one file that ends with register(...) (see CONTRIBUTING.md).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from kvplay.cache.arch import Arch
from kvplay.errors import KvplayError

# ---------------------------------------------------------------------------- bytes

@dataclass(frozen=True)
class CacheBytes:
    """Bytes of a cache, in three categories:
    payload (quantized codes, bit-packed, or fp8 values), metadata (scales and zero points),
    full_precision (16-bit tokens: the residual window, attention sinks, unquantized caches)."""

    payload: int = 0
    metadata: int = 0
    full_precision: int = 0
    # Bytes the storage really holds, spare capacity included; None: exactly the bytes in use (transformers'
    # caches concatenate to size, formulas predict use). Not part of equality: formulas count use.
    allocated: int | None = field(default=None, compare=False)

    @property
    def total(self) -> int:
        return self.payload + self.metadata + self.full_precision

    @property
    def allocated_bytes(self) -> int:
        """Bytes allocated for this storage (>= total): in use plus spare capacity."""
        return self.total if self.allocated is None else self.allocated

    def __add__(self, other: CacheBytes) -> CacheBytes:
        allocated = None if self.allocated is None and other.allocated is None else \
            self.allocated_bytes + other.allocated_bytes
        return CacheBytes(self.payload + other.payload, self.metadata + other.metadata,
                          self.full_precision + other.full_precision, allocated)

    def to_dict(self) -> dict:
        return {"payload": self.payload, "metadata": self.metadata, "full_precision": self.full_precision,
                "total": self.total, "allocated": self.allocated_bytes}


def tensor_nbytes(*tensors) -> int:
    """Bytes of the tensors given (None and non-tensors count 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


# ---------------------------------------------------------------------------- options

ATTENTION = ("fused", "sdpa")       # the `attention` option of kvplay's engine and of the baseline
ATTENTION_HELP = ("fused: CPU decode attention reads the cache directly with kvplay's C kernel (int2/3/4/8 with keys "
                  "per channel and values per token, llama.cpp's quantized types, or 16-bit; models loaded with "
                  "attn_implementation='kvplay', as kvplay loads them); sdpa: the 16-bit history goes to "
                  "transformers' sdpa (quantized caches dequantize it first)")

def option(default, *, choices: tuple = (), lo: float | None = None, hi: float | None = None, help: str = "",
           grid: tuple = (), label: str = ""):
    """A field of a method's Options dataclass.

    choices: the valid values (then the option is an enumeration); otherwise lo..hi bounds a number.
    grid: values worth sweeping (defaults to choices). help/label: shown in the UI and the docs.
    """
    meta = dict(choices=tuple(choices), lo=lo, hi=hi, help=help, grid=tuple(grid) or tuple(choices), label=label)
    return field(default=default, metadata={"kvplay": meta})


def _join(items, last: str = "and") -> str:
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" {last} " + items[-1]


@dataclass(frozen=True)
class OptionSpec:
    """One option of a method, read from its Options dataclass: what the parser, the UI and sweeps use."""

    name: str
    kind: type              # int, float or str
    default: Any
    choices: tuple = ()
    lo: float | None = None
    hi: float | None = None
    help: str = ""
    grid: tuple = ()
    label: str = ""

    def parse(self, raw, where: str):
        """A value from text (or a number), validated; one sentence naming what is valid otherwise."""
        text = str(raw).strip().lower()
        if self.kind is str:
            value = text
        else:
            try:
                value = self.kind(text) if self.kind is float else int(text)
            except ValueError:
                noun = "a number" if self.kind is float else "an integer"
                raise KvplayError(f"Option {self.name}={text!r} in {where!r} must be {noun}.") from None
        if self.choices and value not in self.choices:
            raise KvplayError(f"Option {self.name}={text} in {where!r} is invalid; choose {_join(self.choices, 'or')}.")
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi) \
                or value != value:  # nan
            raise KvplayError(f"Option {self.name}={text} in {where!r} is out of range; it must be between "
                              f"{self.lo:g} and {self.hi:g}.")
        return value


def option_specs(options_cls) -> tuple[OptionSpec, ...]:
    """The OptionSpecs of an Options dataclass, in declaration order (the canonical order of a spec string)."""
    out = []
    for f in fields(options_cls):
        meta = f.metadata.get("kvplay")
        if meta is None:
            raise TypeError(f"{options_cls.__name__}.{f.name} must be declared with option(...).")
        sample = meta["choices"][0] if meta["choices"] else f.default
        kind = float if isinstance(sample, float) else str if isinstance(sample, str) else int
        out.append(OptionSpec(f.name, kind, f.default, meta["choices"], meta["lo"], meta["hi"], meta["help"],
                              meta["grid"], meta["label"] or f.name.replace("_", " ")))
    return tuple(out)


@dataclass(frozen=True)
class NoOptions:
    """Options of a method that takes none."""


# ---------------------------------------------------------------------------- schemes and methods

@dataclass(frozen=True)
class Scheme:
    """A named preset of a method: "kvplay-int4" is kvplay's engine with kbits=vbits=4, group 64.

    preset: the option values that differ from the Options dataclass's defaults. An option set to
    None here does not apply to this scheme, and the parser refuses it.
    """

    name: str
    fmt: str                                  # "bf16", "int", "fp8", ... (for labels and grouping)
    bits: int                                 # nominal bits per stored element
    summary: str
    preset: Mapping = field(default_factory=dict, compare=False, hash=False)
    method: CacheMethod | None = field(default=None, compare=False, hash=False, repr=False)

    @property
    def backend(self) -> str:
        return self.method.name

    def defaults(self):
        """The method's Options instance a bare scheme name stands for."""
        return self.method.Options(**self.preset)

    def options(self) -> tuple[OptionSpec, ...]:
        """The options this scheme accepts (those not None in its defaults), in canonical order."""
        d = self.defaults()
        return tuple(o for o in self.method.option_specs() if getattr(d, o.name) is not None)


class CacheMethod:
    """Base class of a cache method. Subclasses set the class attributes and implement build(),
    layer_nbytes(), analytic_nbytes() and dequantized_kv(); check() and snippet() have defaults."""

    name: ClassVar[str] = ""                 # the backend name: "kvplay", "quanto", ...
    description: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    schemes: ClassVar[tuple[Scheme, ...]] = ()
    layer_types: ClassVar[tuple[type, ...]] = ()   # exactly these classes; subclasses must register too
    full_attention_only: ClassVar[bool] = False    # refuse models with sliding-window or chunked layers
    quantized: ClassVar[bool] = True               # False only for the 16-bit reference
    formula_any_arrival: ClassVar[bool] = True     # analytic_nbytes holds however tokens arrive (not only
                                                   # prefill + one-token decode steps)
    # True: on an empty cache, update() hands attention the 16-bit keys and values it was given (it only stores
    # them its own way), so prefill attention is the 16-bit cache's and one shared 16-bit prefill can fill this
    # method's caches (kvplay.cache.rows; Compare runs it once for every such cache). False (the safe default):
    # its prefill attends over what it stored, or depends on the cache, and it gets a prefill of its own.
    shares_prefill: ClassVar[bool] = False
    # Where people meet it: the group the cache picker, the docs and the verdict name it by.
    family: ClassVar[str] = "other"
    # How its caches look in every tab (kvplay.show.style): a colour family, never red, green or amber (those
    # belong to the verdict), each scheme taking the family's shade at its place in `schemes`; None takes a
    # spare family by the method's name. Line dash and marker symbol for plotly.
    colour_family: ClassVar[str | None] = None     # "grey", "blue", "cyan", "purple", "indigo", "magenta", "slate"
    colour_offset: ClassVar[int] = 0                # its first scheme's shade in the family (families two share)
    line_dash: ClassVar[str] = "dashdot"
    marker: ClassVar[str] = "triangle-up"
    # Where its caches run: "transformers" (build() returns a transformers Cache that kvplay's runners drive),
    # "llama.cpp" (the real engine through llama-cpp-python) or "server" (a running OpenAI-compatible server).
    engine: ClassVar[str] = "transformers"
    # The hook that runs a cache of another engine: the lab module whose RUNNER (kvplay.lab.engines.EngineRunner)
    # runs its specs beside a model's own caches, or on their own. Named as text, because the cache library imports
    # nothing of the lab; kvplay.lab.engines imports it on first use. None: a transformers cache, built here.
    runner: ClassVar[str | None] = None
    # Whether its options join the UI's Advanced controls and the CLI's option help (a server's name does not).
    advanced: ClassVar[bool] = True
    # Its 16-bit window of recent tokens: "slide" (a token is quantized once, when it leaves the window),
    # "flush" (the window fills, then the whole cache is re-quantized at once and the window starts empty), or
    # None (no window: every token is stored quantized as it arrives).
    window: ClassVar[str | None] = None

    # ------------------------------------------------------------------ options
    @classmethod
    def option_specs(cls) -> tuple[OptionSpec, ...]:
        return option_specs(cls.Options)

    @property
    def builds_cache(self) -> bool:
        """Whether build() makes a transformers Cache (the caches every in-process view runs)."""
        return self.engine == "transformers"

    # ------------------------------------------------------------------ spec text
    def shorthand(self, value: str, text: str) -> dict | None:
        """Option values an item without '=' stands for (llama.cpp:q4_0 sets ctk and ctv), validated; None: this
        method takes no shorthand, and the parser asks for key=value."""
        return None

    def spec_text(self, spec) -> str:
        """The spec's one canonical string: the scheme's name, then the options that differ from its preset."""
        default = spec.scheme.defaults()
        opts = [f"{k}={v}" for k, v in spec.option_values().items() if v != getattr(default, k)]
        return spec.name + (":" + ",".join(opts) if opts else "")

    def is_reference(self, spec) -> bool:
        """Whether this spec is a 16-bit reference that others are measured against (the baseline, llama.cpp's
        own f16 cache), so it is not \"smaller than itself\" on a card."""
        return not self.quantized

    # ------------------------------------------------------------------ checks
    def check_model(self, spec, config) -> None:
        """Refuse, before any run, a spec this model cannot take (one sentence)."""
        if self.full_attention_only:
            refuse_sliding_layers(spec, config)
        self.check(spec, Arch.from_config(config))

    def check(self, spec, arch) -> None:
        """Method-specific checks against the model's cache shape (arch.head_dim, ...)."""

    # ------------------------------------------------------------------ the cache
    def build(self, spec, model, tokenizer=None):
        """The transformers Cache for `spec` on this model (tokenizer: for methods that calibrate on text)."""
        raise NotImplementedError

    def calibrate(self, spec, model, tokenizer=None, progress=None) -> None:
        """Measure ahead, reporting progress(fraction, what), whatever build() measures on a calibration text
        that takes long enough to watch; build() then finds it kept. Default: nothing of the kind."""

    def calibrated(self, spec, model) -> bool:
        """Whether what calibrate() measures for `spec` is kept for this model already, so build() is quick and
        a Compare need not hold the cache back while the others decode. Default: there is nothing to measure."""
        return True

    def calibration_parts(self, spec, model) -> dict[str, float]:
        """What calibrate() would measure for `spec` on this model and does not find kept: {part, named by what it
        serves, so that specs sharing one count it once: its estimated seconds here (calibration_time.py)}; empty
        when calibrated(). Default: nothing to measure."""
        return {}

    def layer_nbytes(self, layer) -> CacheBytes:
        """Exact bytes one of this method's layers holds now: storage in use in the three categories, and
        CacheBytes.allocated when its buffers hold spare capacity (None: allocated == in use)."""
        raise NotImplementedError

    def analytic_nbytes(self, spec, arch, tokens: int, *, batch: int = 1, dtype_bytes: int = 2,
                        prefill: int | None = None) -> CacheBytes:
        """Bytes the formula predicts after `tokens` tokens (the layers analytic covers: arch.layers)."""
        raise NotImplementedError

    def dequantized_kv(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """What one of its layers hands attention for its stored history: (K, V), each (B, H, T, D)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ what it is, in words
    def window_reason(self, spec) -> str:
        """Why a short run compresses less than a long one: what the window keeps in 16 bits ("" without one)."""
        if self.window == "slide":
            sink = getattr(spec.options, "sink", 0)
            sink = f" and the first {sink}" if sink else ""
            return f"the newest {spec.options.residual}{sink} tokens stay 16-bit"
        if self.window == "flush":
            return f"up to {spec.options.residual} newest generated tokens stay 16-bit until the window fills"
        return ""

    def key_grouping(self, spec) -> tuple[str, int, bool]:
        """How keys are quantized, for the Inside tab's outlier risk: ("token" | "channel" | "float", bits, rotated).
        The default reads the spec: an int format grouped per token unless its `keys` option says otherwise."""
        options = spec.options
        bits, rotated = int(spec.scheme.bits), getattr(options, "rotation", None) in ("hadamard", "calibrated")
        if spec.scheme.fmt != "int":
            return "float", bits, rotated
        if getattr(options, "keys", None) is not None:
            return options.keys, int(getattr(options, "kbits", 0) or bits), rotated
        return "token", bits, rotated

    def engine_name(self, spec) -> str | None:
        """How users of the engine this spec reproduces name it ("llama.cpp q4_0"), for the verdict; None when
        the spec is no other engine's format (kvplay's own, or transformers' caches run as shipped)."""
        return None

    def own_recipe(self, spec) -> tuple[str, str] | None:
        """(engine, its exact setting) when `spec` is that engine's own cache (the Trade-offs recipe quotes it
        as is), else None: kvplay's methods emulate other engines, transformers' run theirs."""
        return None

    def snippet(self, spec, max_new_tokens: int = 64, load: str = "") -> str:
        """Python that reproduces this cache in the user's own code (MODEL and PROMPT are placeholders;
        `load` replaces the lines that load the model and make `inputs`)."""
        load = load or SNIPPET_LOAD
        if getattr(spec.options, "attention", None) == "fused":      # kvplay's decode attention, registered on import
            load = load.replace(SNIPPET_MODEL, SNIPPET_FUSED_MODEL)
        return (SNIPPET_HEAD + "from kvplay.cache import build_cache\n\n" + load +
                f"cache = build_cache({str(spec)!r}, model, tok)  # a transformers Cache (tok: for caches that "
                "calibrate on text)\n"
                f"out = model.generate(**inputs, max_new_tokens={max_new_tokens}, do_sample=False, "
                "past_key_values=cache)\n")


SNIPPET_HEAD = "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
SNIPPET_MODEL = "model = AutoModelForCausalLM.from_pretrained(MODEL)\n"
SNIPPET_FUSED_MODEL = 'model = AutoModelForCausalLM.from_pretrained(MODEL, attn_implementation="kvplay")\n'
SNIPPET_LOAD = ('tok = AutoTokenizer.from_pretrained(MODEL)\n' + SNIPPET_MODEL +
                'inputs = tok(PROMPT, return_tensors="pt")\n')
SNIPPET_CHAT_LOAD = ('tok = AutoTokenizer.from_pretrained(MODEL)\n' + SNIPPET_MODEL +
                     'inputs = tok.apply_chat_template([{"role": "user", "content": PROMPT}],\n'
                     '                               add_generation_prompt=True, return_tensors="pt",\n'
                     '                               return_dict=True)\n')


# ---------------------------------------------------------------------------- checks written once

def refuse_sliding_layers(spec, config, who: str = "transformers' quantized cache", instead: str = "") -> None:
    """Refuse models with sliding-window or chunked attention layers, as transformers' QuantizedCache does (`who`
    cannot run them; `instead`: what follows the count in the sentence, by default to pick kvplay's presets)."""
    kinds = get_layer_types_and_kwargs(config.get_text_config(decoder=True))[0]
    other = [kind for kind in kinds if kind != "full_attention"]
    if other:
        what = "sliding-window" if set(other) == {"sliding_attention"} else "sliding-window or chunked"
        instead = instead or (f"; pick kvplay-int4 or kvplay-int2, which quantize its {len(kinds) - len(other)} "
                              "full-attention layers and keep the sliding ones in 16-bit.")
        raise KvplayError(f"{spec}: {who} cannot run a model with {what} layers (this one has {len(other)} of "
                          f"{len(kinds)}){instead}")


def require_group_divides(spec, group: int, head_dim: int, why: str = "", *, or_multiple: bool = False) -> None:
    """Refuse a group size that does not divide head_dim (or, with or_multiple, is not a multiple of it)."""
    if head_dim % group == 0 or (or_multiple and group % head_dim == 0):
        return
    also = " or be a multiple of it" if or_multiple else ""
    raise KvplayError(f"{spec}: group size {group} must divide head_dim {head_dim}{also}{' ' + why if why else ''}.")


# ---------------------------------------------------------------------------- the registry

METHODS: dict[str, CacheMethod] = {}
SCHEMES: dict[str, Scheme] = {}
_LAYER_METHODS: dict[type, CacheMethod] = {}


def register(method: CacheMethod) -> CacheMethod:
    """Add a method and its schemes to the registry; returns the method. Names must be new."""
    if not method.name or method.name in METHODS:
        raise ValueError(f"A cache method needs a new name; {method.name!r} is taken or empty.")
    taken = [s.name for s in method.schemes if s.name in SCHEMES]
    if taken or not method.schemes:
        raise ValueError(f"{method.name}: scheme names must be new and at least one: {taken or 'none given'}.")
    method.option_specs()                                       # every field declared with option()
    METHODS[method.name] = method
    for scheme in method.schemes:
        SCHEMES[scheme.name] = Scheme(scheme.name, scheme.fmt, scheme.bits, scheme.summary, dict(scheme.preset), method)
    for layer_type in method.layer_types:
        _LAYER_METHODS.setdefault(layer_type, method)
    return method


def unregister(name: str) -> None:
    """Remove a method and its schemes (for tests that register a temporary one)."""
    method = METHODS.pop(name)
    for scheme in method.schemes:
        SCHEMES.pop(scheme.name, None)
    for layer_type in [t for t, m in _LAYER_METHODS.items() if m is method]:
        del _LAYER_METHODS[layer_type]


def method_for_layer(layer) -> CacheMethod:
    """The method whose layer_types holds this layer's exact class; an unknown class is an error."""
    method = _LAYER_METHODS.get(type(layer))
    if method is None:
        raise KvplayError(f"kvplay does not know the {type(layer).__name__} cache layer; register the method that "
                          "creates it (its layer_types) so its bytes are counted, not guessed.")
    return method


def all_option_names() -> set[str]:
    return {o.name for m in METHODS.values() for o in m.option_specs()}

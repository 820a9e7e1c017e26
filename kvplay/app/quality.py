"""Quality's commands: perplexity, KL and per-layer error on a held-out text (ppl), and the same caches across 2-4
models joined with each cache's bits at 8k tokens (ppl_models: does a verdict carry over?), and one's own model
beside a recorded run of them (beside_recorded). PplPlan and bits_at
are kvplay.app.cells' and kvplay.app.scale's too (the same run on Ray)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from kvplay.app import guard, models
from kvplay.app.checks import check_int, clean_text, parse_specs
from kvplay.app.fetch import model_file
from kvplay.app.inside import needle as find_the_number
from kvplay.app.jobs import Job, Plan, run_plan
from kvplay.app.settings import Settings
from kvplay.cache import CacheSpec, analytic_nbytes, bits_per_element, runnable_specs
from kvplay.cache.arch import Arch, context_limit
from kvplay.errors import KvplayError
from kvplay.lab import engines
from kvplay.lab.compare import LONG_CONTEXT
from kvplay.lab.quality import perplexity_run
from kvplay.lab.texts import HELD_OUT_TEXT
from kvplay.results import ModelRow, ModelsResult


@dataclass
class PplPlan(Plan):
    specs: list[CacheSpec]
    elsewhere: list[CacheSpec]          # run by another engine's runner (kvplay.lab.engines): the real llama.cpp
    text: str | None
    text_name: str
    max_tokens: object
    chunk: int

    def check(self, job: Job) -> int:
        tokens = check_int(self.max_tokens, "Max tokens", 64, job.limit)
        vocab = int(job.model.config.get_text_config(decoder=True).vocab_size)
        job.need(tokens, extra=2 * tokens * vocab * 4)        # the baseline's logits and each spec's
        return tokens

    def run(self, job: Job, tokens: int, progress):
        result = perplexity_run(job.model, job.tokenizer, self.specs, self.text, tokens, self.chunk,
                                text_name=self.text_name or HELD_OUT_TEXT.name, model_name=job.name,
                                weights=job.weights, progress=progress)    # the LoadedModel's weight format
        if self.elsewhere:   # another engine on the same tokens (llama.cpp: its rows against its own f16 cache)
            read = self.text if self.text is not None else HELD_OUT_TEXT.read_text(encoding="utf-8")
            ids = job.tokenizer(read, verbose=False).input_ids[:tokens]
            result.caches += engines.ppl_runs(self.elsewhere, ids, self.chunk, functools.partial(model_file, job.name),
                                              progress)
        yield result


def ppl(model_name, specs, *, text=None, text_name="", max_tokens=2048, chunk=16, device=None, dtype=None,
        weights=None, settings: Settings | None = None, progress=None, cancel: guard.CancelToken | None = None):
    """Perplexity, KL and per-layer error on a held-out text (kvplay.lab.quality.perplexity_run)."""
    settings = settings or Settings.from_env()
    specs, elsewhere = engines.split(parse_specs(specs, settings))
    if text is not None:
        text = clean_text(text, what="The text")
    plan = PplPlan(specs, elsewhere, text, text_name, max_tokens, check_int(chunk, "Chunk", 1, 512))
    return run_plan(model_name, plan, settings=settings, device=device, dtype=dtype, weights=weights,
                    progress=progress, cancel=cancel)


def ppl_models(model_names, specs, *, needle: bool = False, progress=None, **run) -> ModelsResult:
    """ppl() on each of 2-4 models, the same caches and text, joined with each cache's bits per element at 8k
    tokens (or the model's limit) on that model's shape: does a verdict carry over from one model to another?
    needle: also find the number through each cache (the quick grid of kvplay.app.inside.needle) on each model."""

    if isinstance(model_names, str):
        model_names = model_names.split()
    names = list(dict.fromkeys(str(n).strip() for n in model_names or () if str(n).strip()))
    if not 2 <= len(names) <= 4:
        raise KvplayError(f"Compare 2 to 4 different models, got {len(names)}.")
    progress = progress or (lambda fraction, what: None)
    specs = parse_specs(specs, run.get("settings") or Settings.from_env())
    runs, rows = [], []
    for i, name in enumerate(names):
        def part(fraction, what, i=i, name=name):
            progress((i + fraction) / len(names), f"{name}: {what}")
        result, found = _one_model(name, specs, needle, part, run)
        runs.append(result)
        rows += found
    return ModelsResult(long_tokens=LONG_CONTEXT, runs=runs, rows=rows)


def _one_model(name: str, specs, needle: bool, progress, run: dict, label: str = "") -> tuple[object, list[ModelRow]]:
    """ppl() of one model for ppl_models, and its rows (`label`: the model's name in them, default the name): a
    cache this model refuses is a row that says why, not a failed run, even when no other cache runs."""
    share = 0.7 if needle else 1.0                    # of the model's part of the bar: perplexity, then the needle
    config = models.load_config(name)
    arch, tokens = Arch.from_config(config), min(LONG_CONTEXT, context_limit(config) or LONG_CONTEXT)
    ran, refused = runnable_specs(specs, config, teacher_forced=True, require_one=False)
    result = ppl(name, ran, progress=lambda fraction, what: progress(share * fraction, what), **run)
    arch = result.env.arch(arch)                      # the outlier layers the run found, in the bits it quotes
    found = {}
    if needle:
        grid = find_the_number(name, ran, quick=True, settings=run.get("settings"), device=run.get("device"),
                               dtype=run.get("dtype"), weights=run.get("weights"), cancel=run.get("cancel"),
                               progress=lambda fraction, what: progress(share + (1 - share) * fraction, what))
        found = {c.spec: (c.found, c.counted) for c in grid.caches}
    label, rows = label or name, []
    for c in result.caches:
        hits, counted = found.get(c.spec, (None, None))
        rows.append(ModelRow(model=label, spec=c.spec, delta_ppl_pct=c.delta_ppl_pct, mean_kl=c.mean_kl,
                             top1_agreement=c.top1_agreement, bits_long=bits_at(c.spec, arch, tokens),
                             needle_found=hits, needle_counted=counted))
    rows += [ModelRow(model=label, spec=str(s), delta_ppl_pct=None, mean_kl=None, top1_agreement=None,
                      bits_long=None, refused=why) for s, why in refused.items()]
    return result, rows


MEASURED_NOW = " (measured now)"


def beside_name(model_name) -> str:
    """The model a user names to measure beside a recording, or the sentence refusing an empty box."""
    name = str(model_name or "").strip()
    if not name:
        raise KvplayError("Name the model to measure beside the recorded ones (a catalogue name, a GGUF file, a "
                          "folder or a Hub id).")
    return name


def beside_recorded(model_name, recorded: ModelsResult, *, progress=None, **run) -> ModelsResult:
    """A model of one's own beside a recorded across-models run (the Quality tab opens on one): the recording's
    caches on this model under the recording's conditions (its text, tokens and chunk), its column named
    "NAME (measured now)" after the recorded ones, whose figures stay the recording's. A recording on a pasted
    text cannot be matched, so it is refused."""
    first = recorded.runs[0]
    if first.text_name != HELD_OUT_TEXT.name:
        raise KvplayError(f"The recorded run read {first.text_name!r}, which is not shipped: measure the models "
                          "side by side instead.")
    name = beside_name(model_name)
    specs = [s for s in dict.fromkeys(r.spec for r in recorded.rows) if s != "baseline"]
    specs = parse_specs(specs, run.get("settings") or Settings.from_env())
    result, rows = _one_model(name, specs, False, progress or (lambda fraction, what: None),
                              {**run, "max_tokens": first.tokens, "chunk": first.chunk}, label=name + MEASURED_NOW)
    return ModelsResult(long_tokens=recorded.long_tokens, runs=[*recorded.runs, result], rows=[*recorded.rows, *rows])


def bits_at(spec: str, arch: Arch, tokens: int) -> float | None:
    """All-in bits per element at `tokens` from the byte formulas; None for a cache they do not cover."""
    try:
        return bits_per_element(analytic_nbytes(spec, arch, tokens), arch, tokens)
    except KvplayError:
        return None

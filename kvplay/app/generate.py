"""Generate's command: a greedy continuation with the 16-bit cache, the minimal playground (the UI's Generate tab)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from kvplay.app import guard
from kvplay.app.checks import check_int, clean_text, fit_prompt
from kvplay.app.jobs import Job, Plan, run_plan
from kvplay.app.settings import Settings


def _stop_when_cancelled(progress):
    """model.generate stopping criteria that call `progress` (which raises once the run is cancelled) each token."""
    class Cancelled(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            progress(0.0, "generating")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    return StoppingCriteriaList([Cancelled()] if progress is not None else [])


@dataclass
class GeneratePlan(Plan):
    prompt: str
    max_new_tokens: int

    def check(self, job: Job):
        job.need(fit_prompt(job.tokenizer, self.prompt, self.max_new_tokens, job.limit) + self.max_new_tokens)
        return job.tokenizer(self.prompt, return_tensors="pt").to(job.device)

    def run(self, job: Job, ids, progress):
        with torch.inference_mode():
            out = job.model.generate(**ids, max_new_tokens=self.max_new_tokens, do_sample=False,
                                     pad_token_id=job.tokenizer.pad_token_id,
                                     stopping_criteria=_stop_when_cancelled(progress))
        yield self.prompt + job.tokenizer.decode(out[0, ids.input_ids.shape[1]:], skip_special_tokens=True)


def generate_text(model_name: str | None, prompt: str, max_new_tokens, settings: Settings | None = None,
                  cancel: guard.CancelToken | None = None) -> str:
    """Greedy continuation of `prompt` with the 16-bit cache: the minimal playground."""
    settings = settings or Settings.from_env()
    plan = GeneratePlan(clean_text(prompt), check_int(max_new_tokens, "Max new tokens", 1, settings.max_new_tokens))
    return run_plan(model_name, plan, settings=settings, cancel=cancel)

"""The profile command: load any model kvplay can (a catalogue name, a GGUF file, a local folder, a Hub id where
the network allows), then measure what matters for its KV cache (kvplay.lab.profile) in one 16-bit pass."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvplay.app import catalogue, guard
from kvplay.app.jobs import Job, Plan, run_plan
from kvplay.app.settings import Settings
from kvplay.lab.profile import PROFILE_TOKENS, model_profile
from kvplay.results.profile import ModelProfile


@dataclass
class ProfilePlan(Plan):
    load_progress: ClassVar[bool] = True         # a brought model's first load (a GGUF unpacked, a fetch) is shown
    tokens: int = PROFILE_TOKENS

    def check(self, job: Job) -> int:
        job.need(self.tokens)
        return self.tokens

    def run(self, job: Job, checked, progress):
        progress(0.5, "one 16-bit pass over the play")
        yield model_profile(job.model, job.tokenizer, model_name=job.name, tokens=checked)


def profile(model_name, *, device=None, dtype=None, weights=None, settings: Settings | None = None, progress=None,
            cancel: guard.CancelToken | None = None):
    """The model's attention shape and key outlier channels (kvplay.results.profile.ModelProfile)."""
    settings = settings or Settings.from_env()
    return run_plan(model_name, ProfilePlan(), settings=settings, device=device, dtype=dtype, weights=weights,
                    progress=progress, cancel=cancel)


def brought_profile(job: Job) -> ModelProfile | None:
    """The card of a model outside the catalogue, for Compare to carry beside its verdict; None for a catalogue
    model, whose card the page already shows."""
    return None if job.name in catalogue.MODELS else model_profile(job.model, job.tokenizer, model_name=job.name)

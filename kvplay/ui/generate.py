"""The Generate tab: the minimal playground, a greedy continuation with the 16-bit cache."""
from __future__ import annotations

import gradio as gr

from kvplay.app.generate import generate_text
from kvplay.app.prompts import generate_prompt
from kvplay.app.settings import Settings
from kvplay.ui.common import MODEL_JOB, cancel_token, model_box


def make_generate(settings: Settings) -> dict:
    """This tab's handlers (plain functions: the API and the tests call them too)."""
    def generate(model: str | None = None, prompt: str = "", max_new_tokens: int = 48):
        return generate_text(model, prompt, max_new_tokens, settings=settings, cancel=cancel_token(settings))

    return dict(generate=generate)


def generate_tab(h: dict, heavy: dict, settings: Settings, start: str) -> None:
    """Lay out the tab and wire it to its handlers (h: error-wrapped; heavy: also holding the device)."""
    with gr.Tab("Generate"):
        g_model = model_box(settings, start)
        g_prompt = gr.Textbox(value=generate_prompt(start), lines=3, label="Prompt",
                              info="Continued as raw text; for a chat model, a user turn in its chat template.")
        g_max = gr.Slider(1, settings.max_new_tokens, value=min(48, settings.max_new_tokens), step=1,
                          label="Max new tokens")
        g_run = gr.Button("Generate (16-bit cache)")
        g_out = gr.Textbox(label="Output", lines=8)
        g_run.click(heavy["generate"], [g_model, g_prompt, g_max], g_out, api_name="generate", **MODEL_JOB)

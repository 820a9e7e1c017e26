"""The Gradio layout and its wiring. Compute lives in kvplay.service; no torch here."""
from __future__ import annotations

import functools
import os

import gradio as gr

from . import service
from .errors import KvplayError
from .settings import Settings

EXAMPLE_PROMPTS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "Ham.\nTo be, or not to be, that is the question:",
    "KING.\nNow is the winter of our discontent",
]


def user_errors(fn):
    """Show KvplayError as one sentence in the browser (gr.Error), never a traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KvplayError as exc:
            raise gr.Error(str(exc), print_exception=False) from None
    return wrapper


def build_app(settings: Settings | None = None) -> gr.Blocks:
    settings = settings or Settings.from_env()
    with gr.Blocks(title="kvplay: KV-cache quantization playground") as app:
        gr.Markdown("# kvplay\nSee what KV-cache quantization does to a language model.")
        with gr.Tab("Generate"):
            model = gr.Textbox(value=settings.default_model, label="Model (bundled, Hub id or folder)")
            prompt = gr.Textbox(value=EXAMPLE_PROMPTS[0], lines=3, label="Prompt")
            max_new = gr.Slider(1, settings.max_new_tokens, value=min(48, settings.max_new_tokens), step=1,
                                label="Max new tokens")
            go = gr.Button("Generate", variant="primary")
            out = gr.Textbox(label="Output", lines=8)
            gr.Examples(EXAMPLE_PROMPTS, inputs=prompt)
        go.click(user_errors(functools.partial(service.generate_text, settings=settings)),
                 inputs=[model, prompt, max_new], outputs=out, api_name="generate")
    app.queue(default_concurrency_limit=1, max_size=32)
    return app


def launch() -> None:
    build_app().launch(server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                       server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))

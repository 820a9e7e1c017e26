"""The Gradio app: the page, its tabs in order and the launch. Each tab is its own module (compare, deploy,
memory, throughput, quality, generate, tradeoffs, inside) that only lays out components and connects events; compute
lives in kvplay.app (a module per view), pictures in kvplay.show (no torch here). Shared pieces are in kvplay.ui.common.
"""
from __future__ import annotations

import os
from pathlib import Path

import gradio as gr

from kvplay.app import startup
from kvplay.app.settings import Settings
from kvplay.errors import KvplayError
from kvplay.show import style
from kvplay.ui.common import (
    gpu,
    startup_model,
    user_errors,
    warm_start,
)
from kvplay.ui.compare import compare_tab, make_compare, make_servers
from kvplay.ui.deploy import deploy_tab, make_deploy
from kvplay.ui.generate import generate_tab, make_generate
from kvplay.ui.inside import inside_tab
from kvplay.ui.memory import make_memory, memory_tab
from kvplay.ui.quality import make_quality, quality_tab
from kvplay.ui.throughput import make_throughput, throughput_tab
from kvplay.ui.tradeoffs import tradeoffs_tab

ABOUT = (Path(__file__).parent / "about.md").read_text(encoding="utf-8")
# Results areas stay hidden until they hold a result: no placeholder tables or empty plot frames (Compare's by
# this CSS; the other tabs' by a Column each handler makes visible, which the API leaves out of its outputs).
# Every tab bar wraps (build_app sets overflow_behavior="wrap"): at phone width all labels stay whole and
# readable, on two lines, none behind a "more" menu.
PAGE_CSS = """
#kv-results:not(:has(.kv-card)) { display: none; }
/* Nothing drawn before it has data: a plot, file box or table with no value yet takes no room (Gradio draws
   an empty frame with an icon, or a table of headers "1 2 3"). */
.block:has(> .empty[aria-label="Empty value"]) { display: none !important; }
.block:has(> .table-container.no-rows) { display: none !important; }
.column:has(#kv-proj .js-plotly-plot) #kv-proj-hint { display: none; }
/* Compare's plots keep half a row each on a wide screen, drawn or not: the speed plot arrives only when the run
   ends, and a neighbour that had filled the row would keep its full-row drawing, cut off at the box's edge. */
@media (min-width: 641px) { #kv-kl, #kv-agree, #kv-bytes, #kv-speed { flex: 0 0 calc(50% - 8px) !important;
  max-width: calc(50% - 8px); } }
.kv-status-line { margin: 4px 0; color: #444; }
#kv-model-note { border-left: 4px solid #888; padding-left: 8px; }
.table-wrap th .header, .table-wrap th span { word-break: keep-all !important; overflow-wrap: normal !important; }
/* Markdown tables (About): words never split inside a cell; a table wider than its box scrolls inside it. */
.prose table { display: block; overflow-x: auto; max-width: 100%; }
.prose td, .prose th { word-break: normal !important; overflow-wrap: normal !important; hyphens: none !important; }
.prose td:first-child code { white-space: nowrap; }
@media (max-width: 640px) {
  .tab-container button { padding: 4px 8px !important; }
  /* error toasts at the foot of the screen, narrow, clear of the fields being edited */
  .toast-wrap { top: auto !important; bottom: 8px !important; right: 8px !important; left: 8px !important;
                width: auto !important; max-width: none !important; }
}
"""

# Gradio's status tracker writes a queued run's place as "queue: 1/1 | 0.7/58.4s". In words: every model run shares
# one slot (MODEL_JOB), so a waiting run at place N has N runs ahead of it, the one running included; the times are
# Gradio's: seconds waited and, once a run has finished, its estimate of the seconds until the result (average run
# time plus the wait).
# The tracker sets these text nodes itself, so they are reworded where they change.
QUEUE_WORDS_JS = """() => {
  const place = /^queue: (\\d+)\\/\\d* \\|$/, clock = /^([\\d.]+)(?:\\/([\\d.]+))?s$/;
  const blank = (node) => node && (node.nodeType === Node.COMMENT_NODE ||
                                   (node.nodeType === Node.TEXT_NODE && !node.nodeValue.trim()));
  const near = (node, way) => { let n = node[way]; while (blank(n)) n = n[way]; return n; };  // past anchors
  const waited = (node) => {          // the clock beside a reworded place: "0.7/58.4s" or, before any run, "0.7s"
    const t = node && node.nodeType === Node.TEXT_NODE && clock.exec(node.nodeValue.trim());
    if (t) node.nodeValue = `waited ${t[1]} s` + (t[2] ? `; result in about ${Math.round(Number(t[2]))} s` : '');
  };
  const reword = (node) => {
    const m = place.exec((node.nodeValue || '').trim());
    if (m) {
      const n = Number(m[1]);
      node.nodeValue = `waiting: ${n} run${n === 1 ? '' : 's'} ahead of yours (one runs at a time) | `;
      waited(near(node, 'nextSibling'));
      return;
    }
    const before = near(node, 'previousSibling');
    if (before && before.nodeType === Node.TEXT_NODE && before.nodeValue.startsWith('waiting: ')) waited(node);
  };
  const visit = (root) => {
    if (root.nodeType === Node.TEXT_NODE) { reword(root); return; }
    const walk = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    for (let node = walk.nextNode(); node; node = walk.nextNode()) reword(node);
  };
  new MutationObserver((changes) => {
    for (const change of changes) {
      if (change.type === 'characterData') reword(change.target);
      else change.addedNodes.forEach(visit);
    }
  }).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


def make_handlers(settings: Settings) -> dict:
    """Every tab's handlers by name. Each model handler gets a cancel token for its Gradio job: cancelling the
    job or closing the page stops the run at its next step (Gradio itself cannot stop a running worker
    thread), and so does passing settings.max_seconds."""
    return {"compare": make_compare(settings), "compare_servers": make_servers(settings), **make_memory(settings),
            **make_throughput(settings), **make_quality(settings), **make_generate(settings), **make_deploy(settings)}


def build_app(settings: Settings | None = None) -> gr.Blocks:
    settings = settings or Settings.from_env()
    h = {name: user_errors(fn) for name, fn in make_handlers(settings).items()}
    heavy = {name: gpu(h[name]) for name in ("generate", "compare", "memory", "throughput", "quality", "across",
                                             "beside")}
    start, note = startup_model(settings)
    with gr.Blocks(title="kvplay: KV-cache compression playground") as app:
        gr.HTML(f"<style>{style.CARD_CSS}{PAGE_CSS}</style>", padding=False)
        gr.Markdown("# kvplay · what does KV-cache compression really do?\n"
                    "One prompt through a 16-bit KV cache and through compressed caches (fewer bits per number, "
                    "fewer tokens kept, or both), side by side: a verdict per cache, where the text departs, how "
                    "far the next-token distribution drifts, how many bytes are saved and what it costs in speed. "
                    "New here? Press **Compare** and read the **About** tab.")
        compare_tab(app, settings, heavy["compare"], start, note, h["compare_servers"])
        deploy_tab(h, settings, start)
        memory_tab(h, heavy, settings, start)
        throughput_tab(h, heavy, settings, start)
        quality_tab(h, heavy, settings, start)
        generate_tab(h, heavy, settings, start)
        # Further tabs plug in here, one line each (kvplay/ui/tradeoffs.py, kvplay/ui/inside.py).
        tradeoffs_tab(app, settings)
        inside_tab(settings, start)

        with gr.Tab("About"):
            gr.Markdown(ABOUT)
        app.load(None, None, None, js=QUEUE_WORDS_JS, api_name=False)
    # Every tab bar wraps, none hides tabs behind a menu at phone width. The page's own tab bar is an implicit
    # gr.Tabs that exists only once the Blocks has closed, so the config is written again after setting it.
    for block in app.blocks.values():
        if isinstance(block, gr.Tabs):
            block.overflow_behavior = "wrap"
    app.config = app.get_config_file()
    app.queue(max_size=settings.queue_size)
    warm_start(settings, start)
    return app


def launch_kwargs() -> dict:
    # System fonts: a hosted or offline page must not wait on a font CDN.
    theme = gr.themes.Soft(font=["system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"])
    return dict(theme=theme, server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))


def launch() -> None:
    try:
        startup.apply_settings(Settings.from_env())
    except KvplayError as exc:
        raise SystemExit(str(exc)) from None
    startup.build_kernels_in_background()         # compiled while the page opens, not on the first click
    build_app().launch(**launch_kwargs())

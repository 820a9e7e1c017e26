"""Draw a Trade-offs result's chart as a PNG for the docs, in the same headless Chromium the browser tests use.

    python scripts/chart_png.py p.json docs/results/pareto-smollm2.png    # p.json from `python -m kvplay pareto`
    python scripts/chart_png.py p.json out.png --published                # with the published reference points
    python scripts/chart_png.py p.json out.png --at long                  # bytes at 8,192 tokens
    python scripts/chart_png.py t.json out.png                            # `python -m kvplay tasks`: both levers,
                                                                          # at its longest context
    python scripts/chart_png.py m.json out.png                            # `python -m kvplay ppl --models`: the
                                                                          # same caches on several models

plotly's own image export needs kaleido, which kvplay does not install; this writes the figure as a
self-contained HTML page (plotly.js inline, nothing fetched) and screenshots it with Debian's chromium.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from kvplay.lab import tradeoffs as lab_tradeoffs
from kvplay.results import ModelsResult, ParetoResult, TasksResult, from_dict
from kvplay.show import plots, tradeoffs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path, help="a pareto, window-sweep, drift, tasks or ppl --models JSON")
    ap.add_argument("png", type=Path)
    ap.add_argument("--published", action="store_true", help="overlay published points (pareto only)")
    ap.add_argument("--at", choices=["run", "long"], default="run",
                    help="pareto: count bytes at the text's length (run) or at 8,192 tokens (long)")
    ap.add_argument("--width", type=int, default=1000)
    ap.add_argument("--height", type=int, default=None, help="default: the figure's own, else 600")
    args = ap.parse_args()

    result = from_dict(json.loads(args.result.read_text(encoding="utf-8")))
    if isinstance(result, ParetoResult):
        fig = tradeoffs.pareto_figure(result, published=lab_tradeoffs.published_points() if args.published else (),
                                        at=args.at, labels=True)
    elif isinstance(result, TasksResult):
        fig = tradeoffs.tasks_figure(result)
    elif isinstance(result, ModelsResult):
        fig = plots.models_figure(result)
    else:
        fig = tradeoffs.figures(result)[0]
    args.height = args.height or fig.layout.height or 600
    fig.update_layout(width=args.width, height=args.height)
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        page_path = Path(tmp) / "chart.html"
        page_path.write_text(fig.to_html(include_plotlyjs=True, full_html=True), encoding="utf-8")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium",
                                        headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": args.width + 40, "height": args.height + 40})
            page.goto(page_path.as_uri())
            page.wait_for_selector(".main-svg")
            page.locator(".plotly-graph-div").screenshot(path=str(args.png))
            browser.close()
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()

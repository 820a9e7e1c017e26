"""Trade-offs: every cache on one quality-versus-bytes chart, window and sink sweeps, drift over long context.

    pareto_run(model, tok, quick=True)           # ParetoResult: bits per element against mean KL, frontier marked
    window_sweep_run(model, tok, "kvplay-int2")  # WindowSweepResult: residual window x sinks
    drift_run(model, tok, ["kvplay-int4"])       # DriftResult: smoothed KL along a long text
    recipe("kvplay-int4")                        # the nearest settings in other engines (assets/engine_recipes.json)

Every measurement is one teacher-forced pass over the same text per cache (quality.chunked_logits),
judged against one 16-bit pass whose logits are computed once and reused for every configuration.
Bits per element are the live cache's exact bytes (cache_nbytes: payload, metadata and the 16-bit
window) over the elements it holds at the end of the text. The grid comes from the cache registry:
each scheme's preset, plus one-option variants along the options the methods declare a grid for.
"""
from __future__ import annotations

from kvplay.app.tradeoffs import MAX_DRIFT_SPECS, drift, pareto, window_sweep
from kvplay.cli.tradeoffs import COMMANDS, add_parsers, run_cli
from kvplay.lab.tradeoffs.measure import (
    FULL,
    METRICS,
    QUICK,
    RESIDUALS,
    RESULT_KINDS,
    SCHEMES,
    SEMANTICS,
    SINKS,
    VARIANT_OPTIONS,
    DriftCache,
    DriftResult,
    Mode,
    ParetoPoint,
    ParetoResult,
    WindowCache,
    WindowSweepResult,
    drift_run,
    from_dict,
    frontier,
    grid,
    is_result,
    one_pass,
    pareto_run,
    to_dict,
    window_sweep_run,
)
from kvplay.lab.tradeoffs.recipes import PUBLISHED, RECIPES, published_points, recipe, spec_features
from kvplay.show.tradeoffs import TITLES, backend_colour, drift_figures, figures, pareto_figure, window_figure

__all__ = [
    "figures",
    "COMMANDS",
    "add_parsers",
    "run_cli",
    "TITLES",
    "backend_colour",
    "drift_figures",
    "pareto_figure",
    "window_figure",
    "MAX_DRIFT_SPECS",
    "drift",
    "pareto",
    "window_sweep",
    "FULL",
    "METRICS",
    "QUICK",
    "RESIDUALS",
    "RESULT_KINDS",
    "SCHEMES",
    "SEMANTICS",
    "SINKS",
    "VARIANT_OPTIONS",
    "DriftCache",
    "DriftResult",
    "Mode",
    "ParetoPoint",
    "ParetoResult",
    "WindowCache",
    "WindowSweepResult",
    "drift_run",
    "from_dict",
    "frontier",
    "grid",
    "is_result",
    "one_pass",
    "pareto_run",
    "to_dict",
    "window_sweep_run",
    "PUBLISHED",
    "RECIPES",
    "published_points",
    "recipe",
    "spec_features",
]

"""Trade-offs: every cache on one quality-versus-bytes chart, window and sink sweeps, drift over long context.

    pareto_run(model, tok, quick=True)           # ParetoResult: bits per element against mean KL, frontier marked
    window_sweep_run(model, tok, "kvplay-int2")  # WindowSweepResult: residual window x sinks
    drift_run(model, tok, ["kvplay-int4"])       # DriftResult: smoothed KL along a long text
    recipe("kvplay-int4")                        # the nearest settings in other engines (assets/engine_recipes.json)

measure.py measures, recipes.py maps a spec to other engines' settings. The results are in
kvplay.results.tradeoffs, the figures in kvplay.show.tradeoffs, the commands in kvplay.app.tradeoffs.
"""
from kvplay.lab.tradeoffs.measure import (
    FULL,
    QUICK,
    RESIDUALS,
    SCHEMES,
    SEMANTICS,
    SINKS,
    VARIANT_OPTIONS,
    Mode,
    drift_run,
    grid,
    one_pass,
    pareto_run,
    window_sweep_run,
)
from kvplay.lab.tradeoffs.recipes import PUBLISHED, RECIPES, published_points, recipe, spec_features

__all__ = ["FULL", "QUICK", "RESIDUALS", "SCHEMES", "SEMANTICS", "SINKS", "VARIANT_OPTIONS", "Mode", "drift_run",
           "grid", "one_pass", "pareto_run", "window_sweep_run", "PUBLISHED", "RECIPES", "published_points", "recipe",
           "spec_features"]

"""kvplay's cache layer: specs, cache construction and exact byte accounting.

    spec = parse_spec("kvplay-int4:rotation=hadamard")
    cache = build_cache(spec, model)
    model.generate(**inputs, past_key_values=cache)
    cache_nbytes(cache).total

Each cache method is one module in kvplay/cache/methods/ (see CONTRIBUTING.md); the
registry (SCHEMES, METHODS) is what the parser, the UI, the CLI and the docs read.

Built-in methods are found, not listed: importing kvplay.cache imports every module of
kvplay/cache/methods/, and each module that calls register(...) adds its method (base.py and
helper modules register nothing). The registry's order, which is the UI's presets and the docs
tables' order, is then each method's `order` class attribute, lowest first (dynamic 0, quanto 10,
hqq 20, hf-fp8 30, kvplay 40, llamacpp 50, vllm 60); a method without one comes after those,
and ties keep module-name order. Methods registered later (your own) come last.
"""
from __future__ import annotations

import importlib
import pkgutil

from kvplay.cache import calibration_time, evict, outliers
from kvplay.cache import methods as _methods
from kvplay.cache.accounting import CacheBytes, analytic_nbytes, bits_per_element, cache_nbytes
from kvplay.cache.engine import KVPlayCache, KVPlayLayer
from kvplay.cache.methods import METHODS, CacheMethod, method_for_layer, register, unregister
from kvplay.cache.scheme_table import scheme_table
from kvplay.cache.spec import (
    DEFAULT_SPECS,
    SCHEMES,
    CacheSpec,
    Scheme,
    advanced_options,
    baseline_first,
    cache_schemes,
    defaults,
    parse_spec,
    spec_help,
)
from kvplay.errors import KvplayError

__all__ = ["SCHEMES", "METHODS", "DEFAULT_SPECS", "CacheSpec", "Scheme", "CacheMethod", "CacheBytes", "KVPlayCache",
           "KVPlayLayer", "parse_spec", "defaults", "baseline_first", "cache_schemes",
           "build_cache", "cache_nbytes", "analytic_nbytes",
           "bits_per_element", "check_spec_for_model", "check_specs", "runnable_specs", "calibrate",
           "calibration_seconds", "register", "unregister",
           "method_for_layer", "advanced_options", "spec_help", "scheme_table", "dequantized_kv", "key_outliers",
           "adapting_presets"]

UNORDERED = 1000     # the `order` of a built-in method that declares none: after those that do


def _discover_builtins() -> None:
    """Import every module of kvplay/cache/methods/ (by module name), then put the registry in `order`."""
    for module in sorted(pkgutil.iter_modules(_methods.__path__), key=lambda m: m.name):
        importlib.import_module(f"{_methods.__name__}.{module.name}")
    place = {name: (getattr(m, "order", UNORDERED), i) for i, (name, m) in enumerate(METHODS.items())}
    for registry, method_of in ((METHODS, lambda item: item[0]), (SCHEMES, lambda item: item[1].method.name)):
        ordered = sorted(registry.items(), key=lambda item: place[method_of(item)])      # stable: schemes keep
        registry.clear()                                                                 # their method's order
        registry.update(ordered)


_discover_builtins()


def check_spec_for_model(spec: CacheSpec, config) -> None:
    """Refuse, before any run, a spec that cannot work on this architecture (one sentence)."""
    spec.method.check_model(spec, config)


def _check_view(spec: CacheSpec, teacher_forced: bool) -> None:
    """Refuse, in one sentence, a spec that runs in another engine (the real llama.cpp, a server), and an evicting
    cache in a teacher-forced view (perplexity, KL, errors over a text), which would fault it for what the text
    needs later."""
    if teacher_forced and evict.policy_of(spec) is not None:
        raise KvplayError(f"{spec} evicts tokens, which is judged on tasks whose question ends the prompt "
                          "(python -m kvplay tasks, or Find the number): a view over a fixed text would fault it "
                          "for dropping context the text needs later.")
    if not spec.method.builds_cache:
        raise KvplayError(f"{spec} runs in {spec.method.engine}, not as a transformers cache: this view measures "
                          "transformers caches (Compare and Quality also run the real llama.cpp).")


def check_specs(specs, config, *, teacher_forced: bool = False) -> list[CacheSpec]:
    """The run's transformers caches, parsed once, baseline first, each checked against the view (_check_view) and
    the model once."""
    specs = baseline_first(specs)
    for spec in specs:
        _check_view(spec, teacher_forced)
        check_spec_for_model(spec, config)
    return specs


def runnable_specs(specs, config, *, teacher_forced: bool = False,
                   require_one: bool = True) -> tuple[list[CacheSpec], dict[str, str]]:
    """check_specs for a side-by-side run: the specs this model can run, baseline first, and those its architecture
    refuses (check_spec_for_model), each with the refusal's sentence (transformers' quantized cache on Gemma 3's
    sliding layers), for the run to show beside the others instead of failing whole. When it would leave nothing
    to compare, the first refusal is the error (unless not `require_one`: a row of a table across models); a spec
    the view cannot take raises too. Each is checked once."""
    ok, refused = [], {}
    for spec in baseline_first(specs):
        _check_view(spec, teacher_forced)
        try:
            check_spec_for_model(spec, config)
        except KvplayError as exc:
            refused[str(spec)] = str(exc)
            continue
        ok.append(spec)
    if require_one and refused and len(ok) == 1:
        raise KvplayError(next(iter(refused.values())))
    return ok, refused


def build_cache(spec: CacheSpec | str, model, tokenizer=None):
    """The transformers Cache object for `spec`, ready for model.generate(past_key_values=...).

    A string is parsed and checked against the model here; a CacheSpec is taken as checked
    (the runners check each spec once per run, with check_specs), so nothing is re-done per cache.
    The tokenizer serves specs that calibrate on text (kvplay's `fragile` layers, calibrated key rotations) when
    nothing is kept for this model yet; kvplay's runners call calibrate() with it first, so their builds need none.
    """
    if not isinstance(spec, CacheSpec):
        spec = parse_spec(spec)
        check_spec_for_model(spec, model.config)
    return spec.method.build(spec, model, tokenizer)


def calibrate(specs, model, tokenizer=None, progress=None) -> None:
    """Measure ahead what the run's checked specs calibrate on this model, once per model (kvplay's fragile
    layers and key rotations, for a model nothing is kept for), reporting progress(fraction, what), the first
    message saying how long it should take (calibration_seconds); build_cache then finds it kept. The runners call
    it after check_specs, so a first run on a new model or storage shows what it waits for."""
    if progress is not None:
        parts = {str(s): s.method.calibration_parts(s, model) for s in specs}
        if any(parts.values()):
            names = ", ".join(name for name, mine in parts.items() if mine)
            progress(0.0, f"{names}: calibrating once for this model, "
                          f"{calibration_time.words(calibration_time.estimate(list(parts.values())))} on this "
                          "machine (estimated)")
    for spec in specs:
        spec.method.calibrate(spec, model, tokenizer, progress)


def calibration_seconds(specs, model) -> float:
    """About how long calibrate(specs, model) takes on this machine, a part several specs share counted once; 0 when
    everything is kept (calibration_time.py)."""
    return calibration_time.estimate([s.method.calibration_parts(s, model) for s in specs])


def dequantized_kv(layer):
    """What a cache layer hands attention for its stored history: (K, V), each (B, H, T, D)."""
    return method_for_layer(layer).dequantized_kv(layer)


def key_outliers(model, tokenizer) -> list[outliers.LayerKeys] | None:
    """Each full-attention layer's keys as outliers.py tests them (kept, or one 16-bit pass, once per model), set on
    the model's config so Arch.from_config counts the adapting presets' 8-bit keys from the start: what kvplay's
    loader does with every model it loads. None for a model that does not run kvplay's attention."""
    if not outliers.measurable(model):
        return None
    return outliers.find(model, tokenizer, parse_spec(outliers.REFERENCE))


def adapting_presets() -> list[str]:
    """The presets that store outlier layers' keys at outliers.BITS (their `adapt` option set), registry order."""
    return [name for name, scheme in SCHEMES.items() if getattr(scheme.defaults(), "adapt", None)]

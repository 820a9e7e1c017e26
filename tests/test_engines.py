"""A cache that runs in another engine reaches Compare and Quality through its method's own hook (kvplay.lab.engines):
a method registered here, with its runner module, gets its rows beside kvplay's with no line of the app changed;
and the app and the UI hold no branch on a backend."""
import ast
import sys
import types
from pathlib import Path

import pytest

from kvplay.app import compare, quality
from kvplay.app.models import BUNDLED_NAME
from kvplay.app.settings import Settings
from kvplay.cache import parse_spec
from kvplay.cache.methods import CacheMethod, Scheme, register, unregister
from kvplay.errors import KvplayError
from kvplay.lab import engines
from kvplay.results import CacheRun, PplRun

ROOT = Path(__file__).resolve().parents[1]
RUNNER = "kvplay_test_echo_runner"
GREEDY_ONLY = "The echo engine runs greedy at batch size 1."


def _row(spec: str, tokens: list[int]) -> CacheRun:
    n = len(tokens)
    return CacheRun(spec=spec, text="x" * n, token_ids=tokens, tokens=["x"] * n, first_divergence=None,
                    match_fraction=1.0, diff_spans=[], kl=[0.0] * n, top1=[True] * n, baseline_logprob=[-1.0] * n,
                    mean_kl=0.0, max_kl=0.0, top1_agreement=1.0, context_tokens=list(range(4, 4 + n)),
                    cache_bytes_per_step=[100] * n, cache_bytes=100, baseline_bytes=100, compression=1.0,
                    bits_per_element=16, prefill_s=0.1, prefill_tokens_per_s=40.0, decode_tokens_per_s=0.0,
                    wall_s=1.0, top5_ids=[[1]] * n, top5_probs=[[0.5]] * n, top5_tokens=[["x"]] * n)


class EchoRunner(engines.EngineRunner):
    """Answers with the baseline's own tokens, and writes down what the hook was handed."""

    def __init__(self):
        self.calls = []

    def check(self, specs, *, batch_size, temperature):
        if batch_size != 1:
            raise KvplayError(GREEDY_ONLY)

    def compare_runs(self, specs, job, base_tokens, model_file, progress):
        try:
            model_file(".gguf")
            found = None
        except KvplayError as exc:
            found = str(exc)
        self.calls.append(("compare", [str(s) for s in specs], list(base_tokens), job.model_name, found))
        return [_row(str(spec), list(base_tokens)) for spec in specs]

    def ppl_runs(self, specs, ids, chunk, model_file, progress):
        self.calls.append(("ppl", [str(s) for s in specs], len(ids), chunk))
        return [PplRun(spec=str(s), ppl=1.0, delta_ppl_pct=0.0, mean_kl=0.0, top1_agreement=1.0, kl_along_text=[],
                       layer_key_error=[], layer_value_error=[]) for s in specs]


class Echo(CacheMethod):
    name = "echo"
    engine = "echo"
    runner = RUNNER
    order = 99
    advanced = False
    description = "the baseline's text again, from another engine (a test's)"
    schemes = (Scheme("echo", "echo", 16, "the baseline's text again"),)

    def check_model(self, spec, config) -> None:       # nothing to install, any model
        pass


@pytest.fixture
def echo(monkeypatch):
    """The echo method registered and its runner module importable; both gone after the test."""
    module = types.ModuleType(RUNNER)
    module.RUNNER = EchoRunner()
    monkeypatch.setitem(sys.modules, RUNNER, module)
    register(Echo())
    try:
        yield module.RUNNER
    finally:
        unregister("echo")


def test_another_engines_rows_join_a_compare_through_its_methods_runner(echo, bundled):
    result = compare.compare(BUNDLED_NAME, ["kvplay-int4", "echo"], "ROMEO:\n", 4, settings=Settings())
    assert [c.spec for c in result.caches] == ["baseline", "kvplay-int4", "echo"]
    base = result.caches[0].token_ids
    assert len(base) == 4 and result.caches[2].token_ids == base
    # handed the baseline's tokens, the model's name and where to find its files (the bundled model has no GGUF)
    assert echo.calls == [("compare", ["echo"], base, BUNDLED_NAME,
                           "This engine runs GGUF files; shakespeare-llama has none (try smollm2-135m-instruct).")]


def test_another_engines_rows_join_a_perplexity_run_on_the_same_tokens(echo, bundled):
    result = quality.ppl(BUNDLED_NAME, ["kvplay-int4", "echo"], max_tokens=64, chunk=16, settings=Settings())
    assert [c.spec for c in result.caches][-1] == "echo" and result.tokens == 64
    assert echo.calls == [("ppl", ["echo"], 64, 16)]


def test_the_runner_refuses_what_its_engine_cannot_run_before_any_model_loads(echo):
    with pytest.raises(KvplayError, match=f"^{GREEDY_ONLY}$"):
        compare.compare("no-such-model-is-loaded", ["echo"], "Hello", 4, batch_size=2, settings=Settings())
    assert echo.calls == []


def test_the_real_llama_cpps_hook_runs_greedy_only_and_needs_the_models_gguf(bundled, monkeypatch):
    """Its runner (kvplay.lab.llamacpp.RUNNER) refuses sampling before any model loads, adds no row for its f16
    reference alone, and says in one sentence that the bundled model has no GGUF (with llama-cpp-python taken as
    installed: the runs themselves are tests/test_llamacpp.py's)."""
    from kvplay.cache.methods import llamacpp_real
    from kvplay.lab import llamacpp

    monkeypatch.setattr(llamacpp_real, "require", lambda: None)
    assert engines.runner(parse_spec("llama.cpp").method) is llamacpp.RUNNER
    with pytest.raises(KvplayError, match="^The real llama.cpp runs greedy at batch size 1; set the batch size to 1"):
        compare.compare("no-such-model-is-loaded", ["llama.cpp:q8_0"], "Hello", 4, temperature=0.7)
    alone = compare.compare(BUNDLED_NAME, ["llama.cpp"], "ROMEO:\n", 2, batch_size=2, settings=Settings())
    assert [c.spec for c in alone.caches] == ["baseline"]
    with pytest.raises(KvplayError, match=r"^This engine runs GGUF files; shakespeare-llama has none \(try "):
        compare.compare(BUNDLED_NAME, ["llama.cpp:q8_0"], "ROMEO:\n", 2, settings=Settings())


def test_a_transformers_cache_has_no_runner_and_a_server_none_in_a_models_run():
    assert engines.split([parse_spec("kvplay-int4")]) == ([parse_spec("kvplay-int4")], [])
    with pytest.raises(KvplayError, match="runs as a transformers cache"):
        engines.runner(parse_spec("kvplay-int4").method)
    with pytest.raises(KvplayError, match="is a running server: compare servers with each other"):
        engines.split([parse_spec("server:q4")])


def _branches_on_a_backend(path: Path) -> list[str]:
    """Imports of a runner module, a runner module reached through another (lab.llamacpp), and comparisons with a
    method's `engine`, in one module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            found += sorted(n for n in names if n in ("kvplay.lab.llamacpp", "kvplay.lab.servers"))
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name in ("kvplay.lab.llamacpp", "kvplay.lab.servers")]
        elif isinstance(node, ast.Attribute) and (node.attr == "llamacpp" or node.attr == "servers" and isinstance(
                node.value, ast.Name) and node.value.id == "lab"):                 # not settings.servers
            found.append(f"line {node.lineno}: a runner module reached as .{node.attr}")   # lab.llamacpp.available()
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            found += [f"line {node.lineno}: .engine compared" for s in sides
                      if isinstance(s, ast.Attribute) and s.attr == "engine"]
    return found


def test_the_app_and_the_ui_hold_no_branch_on_a_backend():
    modules = sorted((ROOT / "kvplay" / "app").glob("*.py")) + sorted((ROOT / "kvplay" / "ui").glob("*.py"))
    assert len(modules) > 20
    assert {str(m.relative_to(ROOT)): found for m in modules if (found := _branches_on_a_backend(m))} == {}

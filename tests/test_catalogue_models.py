"""Qwen2.5-Coder-0.5B-Instruct and Gemma 3 270M next to SmolLM2: a task with an answer on every model, and each
real model loaded as the catalogue describes it, answering its default task right with the 16-bit cache.

The tasks need no model. Tests marked real_model skip, with the fetch command, when their model is not cached
(.ci/run fetches all three); each loads its model once (module scope).
"""
import pytest
import torch

from kvplay.app import catalogue, fetch, prompts
from kvplay.cache.arch import Arch

FETCHED = [name for name, e in catalogue.MODELS.items() if e.wheel is not None]
# What each real model is (tests/test_real_model.py checks SmolLM2's the same way): full-attention layers, KV heads,
# head_dim, sliding-window layers, window, chat template.
SHAPES = {catalogue.REAL_MODEL: (30, 3, 64, 0, 0, True), catalogue.QWEN: (24, 2, 64, 0, 0, True),
          catalogue.GEMMA: (3, 1, 256, 15, 512, False)}


# ---------------------------------------------------------------------------- the tasks (no model)

@pytest.mark.parametrize("name", FETCHED)
def test_every_real_catalogue_model_opens_on_the_pass_code_task(name):
    task = prompts.tasks(name)[0]
    assert task.expected == prompts.PASS_CODE and task.prompt == prompts.default_prompt(name)
    assert prompts.PASS_NOTE.format(code=prompts.PASS_CODE) in task.prompt
    assert prompts.example_prompts(name) == [t.prompt for t in prompts.tasks(name)[1:]]
    wording = prompts.PASS_QUESTION if catalogue.MODELS[name].chat else prompts.PASS_COMPLETION
    assert task.prompt.endswith(wording)


def test_a_base_model_gets_the_same_task_as_text_to_complete():
    chat, completion = prompts.chat_tasks(), prompts.completion_tasks()
    assert prompts.prompting(catalogue.GEMMA) == "completion" and not catalogue.MODELS[catalogue.GEMMA].chat
    for asked, completed in zip(chat[:2], completion[:2]):
        assert asked.expected == completed.expected and asked.slug != completed.slug
        document = asked.prompt.rsplit("\n\n", 1)[0]                     # the same document, another question
        assert completed.prompt.startswith(document) and completed.prompt.endswith(" is")
        assert prompts.task_for(completed.prompt) == completed
    assert completion[2].expected is None                                 # an opening to continue, said so


def test_a_model_outside_the_catalogue_gets_the_task_not_a_raw_excerpt():
    class Tok:
        chat_template = None

    class ChatTok:
        chat_template = "{{ messages }}"

    assert prompts.default_prompt("someone/base-model") == prompts.completion_tasks()[0].prompt
    assert prompts.default_prompt("someone/base-model", Tok()) == prompts.completion_tasks()[0].prompt
    assert prompts.default_prompt("someone/chat-model", ChatTok()) == prompts.chat_tasks()[0].prompt
    assert prompts.tasks("someone/base-model")[0].expected == prompts.PASS_CODE
    assert all(t.expected is None for t in prompts.tasks(catalogue.BUNDLED))        # only the toy model continues


# ---------------------------------------------------------------------------- the real models

def _cached(name: str):
    if fetch.cached_path(name) is None:
        pytest.skip(f"{name} is not cached: python -m kvplay fetch {name}")


@pytest.fixture(scope="module", params=FETCHED)
def loaded(request):
    from kvplay.app.models import load_model

    _cached(request.param)
    model, tok = load_model(request.param, device="cpu")
    return request.param, model, tok


@pytest.mark.real_model
def test_loads_offline_as_the_catalogue_describes(loaded):
    name, model, tok = loaded
    arch = Arch.from_config(model.config)
    layers, kv_heads, head_dim, sliding, window, chat = SHAPES[name]
    assert (arch.layers, arch.kv_heads, arch.head_dim, arch.sliding_layers, arch.sliding_window) == \
        (layers, kv_heads, head_dim, sliding, window)
    assert bool(tok.chat_template) == chat == catalogue.MODELS[name].chat
    assert model.config.max_position_embeddings == catalogue.MODELS[name].context
    assert model.dtype == torch.bfloat16
    for kept in fetch._beside(catalogue.MODELS[name], fetch.target(name).parent):   # the Gemma terms, with it
        assert kept.stat().st_size > 0


@pytest.mark.real_model
def test_the_16_bit_cache_answers_the_default_task_right(loaded):
    """Greedy, 16-bit cache, the model's own wording (chat template for chat models, to complete for base ones).
    Measured: SmolLM2 and Qwen "The pass code for the ship's strongroom is 27611.", Gemma 3 " 27611." then more."""
    from kvplay.cache import build_cache, parse_spec
    from kvplay.lab.generate import generate

    name, model, tok = loaded
    task, chat = prompts.tasks(name)[0], prompts.is_chat(name, tok)
    ids = torch.tensor([prompts.encode(tok, task.prompt, chat=chat)])
    trace = generate(model, ids, build_cache(parse_spec("baseline"), model), task.max_new_tokens, keep_logits=False,
                     stop_token=tok.eos_token_id if chat else None)
    text = tok.decode(trace.tokens[0], skip_special_tokens=True)
    assert prompts.grade(text, task.expected, task.check) == (task.expected, True), text
    if chat:
        assert int(trace.tokens[0, -1]) == tok.eos_token_id, text             # a whole answer, not cut
    else:
        assert text.split()[0].strip(".") == task.expected, text              # the completion starts with it


@pytest.mark.real_model
def test_the_generate_prompt_is_each_chat_models_own_template_or_a_completion(loaded):
    name, model, tok = loaded
    if catalogue.MODELS[name].chat:
        turn = [{"role": "user", "content": prompts.GENERATE_QUESTION}]
        assert prompts.generate_prompt(name) == tok.apply_chat_template(turn, tokenize=False,
                                                                        add_generation_prompt=True)
    else:
        assert prompts.generate_prompt(name) == prompts.GENERATE_COMPLETION

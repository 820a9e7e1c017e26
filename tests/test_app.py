"""The app, launched for real and called through gradio_client."""
import pytest

from kvplay.settings import Settings


@pytest.fixture(scope="module")
def client():
    from gradio_client import Client

    from kvplay.ui import build_app

    app = build_app(Settings(max_new_tokens=64))
    app.launch(server_name="127.0.0.1", server_port=None, prevent_thread_lock=True, quiet=True)
    try:
        yield Client(app.local_url, verbose=False)
    finally:
        app.close()


def test_generate_endpoint_answers(client):
    out = client.predict("shakespeare-llama", "ROMEO:\n", 12, api_name="/generate")
    assert isinstance(out, str) and out.startswith("ROMEO:\n") and len(out) > len("ROMEO:\n")


@pytest.mark.parametrize("prompt, max_new, sentence", [
    ("   ", 12, "Prompt is empty"),
    # the slider's own range check answers first, in one sentence too
    ("ROMEO:", 0, "less than minimum value 1"),
    ("ROMEO:", 1000, "greater than maximum value 64"),
])
def test_generate_rejects_bad_input_with_one_sentence(client, prompt, max_new, sentence):
    with pytest.raises(Exception, match=sentence):
        client.predict("shakespeare-llama", prompt, max_new, api_name="/generate")


def test_app_keeps_serving_after_errors(client):
    with pytest.raises(Exception):
        client.predict("nobody-xyz/none", "ROMEO:", 4, api_name="/generate")
    assert client.predict("shakespeare-llama", "ROMEO:", 4, api_name="/generate").startswith("ROMEO:")

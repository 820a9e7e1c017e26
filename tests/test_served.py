"""The app as a Space or a busy demo laptop runs it: `python app.py` in its own process, with the real model.

- a hosted start (SPACE_ID set) keeps the hosted limits; with no network and no cached model it opens on
  the bundled model with a note (CI's smoke step covers the start that fetches the real model);
- a page closed mid-run stops that run within seconds, in every tab;
- many clients pressing Compare at once are served in queue order or told at once that the queue is full,
  and no default run is stopped by the CPU-time limit.
"""
from __future__ import annotations

import threading
import time

import pytest
from served import Served, cpu_stops

REAL = "smollm2-135m-instruct"
real_model = pytest.mark.real_model
pytestmark = pytest.mark.slow      # every test here starts `python app.py` in its own process


def _error(job) -> str:
    done = job.wait_for("process_completed")
    assert done.get("success") is False, done
    return done["output"].get("error") or ""


# ---------------------------------------------------------------------------- a hosted start

@pytest.fixture(scope="module")
def hosted():
    with Served(env={"SPACE_ID": "kvplay/test", "GRADIO_SERVER_NAME": "0.0.0.0"}) as app:
        yield app


def _model_value(app: Served) -> str:
    _, dep = app._dependency("compare")
    comps = {c["id"]: c for c in app.config()["components"]}
    return comps[dep["inputs"][0]]["props"]["value"]


@real_model
def test_a_hosted_start_opens_on_the_real_model(hosted):
    assert _model_value(hosted) == REAL


@real_model
@pytest.mark.parametrize(("label", "value", "says"), [
    ("Model", "/tmp", "local"),                               # a visitor never reads the server's disk
    ("Max new tokens", 10_000, "maximum value 128"),          # the hosted caps on tokens, batch and caches
    ("Batch size", 64, "maximum value 8"),
    ("Extra specs", "kvplay-int4:group=32 kvplay-int4:group=128 kvplay-int2:group=128", "At most 6"),
])
def test_a_hosted_start_keeps_the_hosted_limits(hosted, label, value, says):
    with hosted.join("compare", **{label: value}) as job:
        message = _error(job)
    assert says in message and "\n" not in message and "Traceback" not in message


def test_a_hosted_start_with_no_network_opens_on_the_bundled_model(tmp_path):
    links = tmp_path / "links"
    links.mkdir()
    env = {"SPACE_ID": "kvplay/test", "KVPLAY_MODEL_DIR": str(tmp_path / "models"), "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": str(links)}
    with Served(env=env) as app:
        assert _model_value(app) == "shakespeare-llama"
        page = str(app.config())
    assert f"python -m kvplay fetch {REAL}" in page


# ---------------------------------------------------------------------------- a closed page stops its run

CLIENTS = 16
WAITING = 1          # KVPLAY_QUEUE_SIZE here: one run active, one waiting, the rest turned away


@pytest.fixture(scope="module")
def served():
    """One server for the closed pages and the many clients (a start with the real model: ~30 s on 2 cores)."""
    with Served(env={"KVPLAY_QUEUE_SIZE": str(WAITING)}) as app:
        yield app


# Each tab's heavy endpoint, with inputs (by label) that keep it busy for well over the test's few seconds.
RUNS = [
    ("compare", {}),
    ("memory", {"Grow the cache to (tokens)": 8192, "Tokens per step": 1}),
    ("throughput", {}),
    ("quality", {}),
    ("pareto", {}),
    ("inside_errors", {"Tokens of the held-out play": 2048}),   # 512 (the default) can end within the 4 s here
    ("inside_needle", {}),
]


@real_model
@pytest.mark.parametrize(("api", "inputs"), RUNS, ids=[r[0] for r in RUNS])
def test_a_closed_page_stops_its_run(served, api, inputs):
    inputs = {k: v for k, v in inputs.items() if k in served.labels(api)}
    job = served.join(api, **inputs)
    job.wait_for("process_starts")
    time.sleep(2)
    before = served.cpu_seconds()
    time.sleep(2)
    busy = (served.cpu_seconds() - before) / 2                 # CPU s per s; idle, the server uses ~0.01
    assert busy > 0.15, f"{api} was not computing when the page closed ({busy:.2f} CPU s per s)"
    job.close()
    stopped = cpu_stops(served, within=15, idle=max(0.1, 0.2 * busy * 2))
    assert stopped is not None, f"{api} kept computing for 15 s after its page closed"
    print(f"\n{api}: {busy:.2f} CPU s per s while running; idle {stopped:.1f} s after its page closed")


# ---------------------------------------------------------------------------- many clients at once

@real_model
def test_sixteen_clients_are_served_in_order_or_told_the_queue_is_full(served):
    """Two default Compares run (87 s for both on 2 AVX2 cores), one after the other; fourteen are refused."""
    jobs = []
    for _ in range(CLIENTS):
        t0 = time.monotonic()
        job = served.join("compare")
        jobs.append((job, time.monotonic() - t0))
    try:
        running = [j for j, _ in jobs if j.status == 200]
        refused = [(j, s) for j, s in jobs if j.status != 200]
        assert len(running) == 1 + WAITING and len(refused) == CLIENTS - 1 - WAITING
        for job, seconds in refused:                     # told at once, in one sentence
            assert job.status == 503 and seconds < 5
            assert "Queue is full" in str(job.joined)
        done: dict[int, tuple[float, dict]] = {}

        def follow(i, job):                              # each client reads its own stream, as a browser does
            msg = job.wait_for("process_completed", timeout=900)
            done[i] = (time.monotonic(), msg)
        threads = [threading.Thread(target=follow, args=(i, j)) for i, j in enumerate(running)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(done) == list(range(len(running)))
        for _, msg in done.values():                     # no default run is stopped by a limit
            assert msg.get("success") is True, msg
        order = [i for i, _ in sorted(done.items(), key=lambda kv: kv[1][0])]
        assert order == sorted(order)                    # queue order: first to join, first served
    finally:
        for job, _ in jobs:
            job.close()

"""The playground as a user meets it: `python app.py` in its own process, driven over HTTP.

    with Served(env={"KVPLAY_QUEUE_SIZE": "4"}) as app:    # waits until the page serves
        app.config()["components"]                          # what the page is built from
        with app.join("compare", prompt="...") as job:      # a queued event, its SSE stream open
            job.wait_for("process_starts")
        # leaving the block closes the stream, as closing the browser tab does

Gradio's own client cannot drop its connection mid-run, which is what a closed tab does;
this speaks Gradio 6's queue protocol (queue/join, then the queue/data event stream) directly.
`cpu_seconds()` reads the server process's CPU time, so a test can see whether a run stopped.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """One queued event and its open event stream."""

    def __init__(self, app: Served, fn_index: int, data: list):
        self.session = uuid.uuid4().hex[:12]
        self.messages: list[dict] = []
        r = httpx.post(f"{app.url}/gradio_api/queue/join", timeout=120,
                       json={"data": data, "fn_index": fn_index, "session_hash": self.session,
                             "event_data": None, "trigger_id": None})
        self.joined = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        self.status = r.status_code
        self._client = httpx.Client(timeout=None)
        self._stream = None
        if self.status != 200:          # turned away (a full queue): a browser opens no event stream either
            self._lines = iter(())
            return
        self._stream = self._client.stream("GET", f"{app.url}/gradio_api/queue/data",
                                           params={"session_hash": self.session})
        self._response = self._stream.__enter__()
        self._lines = self._response.iter_lines()

    def next_message(self) -> dict:
        for line in self._lines:
            if line.startswith("data:"):
                msg = json.loads(line[5:])
                self.messages.append(msg)
                return msg
        raise EOFError("the event stream ended")

    def wait_for(self, kind: str, timeout: float = 600) -> dict:
        """Read the stream until a message of this kind ("process_starts", "process_completed", ...)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self.next_message()
            if msg.get("msg") == kind:
                return msg
        raise TimeoutError(f"no {kind} within {timeout} s")

    def close(self) -> None:
        """Drop the connection, as a closed tab does."""
        if self._stream is not None:
            with contextlib.suppress(Exception):
                self._stream.__exit__(None, None, None)
        self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Served:
    """`python app.py` on a free loopback port, with extra environment variables."""

    def __init__(self, env: dict[str, str] | None = None, timeout: float = 300):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "GRADIO_SERVER_PORT": str(self.port), "GRADIO_ANALYTICS_ENABLED": "False",
                    **(env or {})}
        if "KVPLAY_DEFAULT_MODEL" not in (env or {}):      # conftest points tests at the bundled model
            self.env.pop("KVPLAY_DEFAULT_MODEL", None)
        self.timeout = timeout
        self.log = ""
        self._config = None

    def __enter__(self) -> Served:
        self.proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.ps = psutil.Process(self.proc.pid)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"app.py exited with {self.proc.returncode}: {self.proc.stdout.read()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/config", timeout=5).status_code == 200:
                    # the app loads (and warms up) its model in the background: wait for that to finish, so a
                    # test's CPU readings are its own run's
                    cpu_stops(self, within=self.timeout, idle=0.2)
                    return self
            time.sleep(0.5)
        self.__exit__()
        raise TimeoutError(f"app.py did not serve within {self.timeout} s")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        self.log = out or ""

    def config(self) -> dict:
        if self._config is None:
            self._config = httpx.get(f"{self.url}/config", timeout=30).json()
        return self._config

    def cpu_seconds(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def _dependency(self, api_name: str) -> tuple[int, dict]:
        for i, dep in enumerate(self.config()["dependencies"]):
            if dep.get("api_name") == api_name:
                return dep.get("id", i), dep
        raise KeyError(f"no endpoint {api_name!r}")

    def defaults(self, api_name: str) -> list:
        """The endpoint's inputs as the page starts (each component's initial value), in order."""
        _, dep = self._dependency(api_name)
        comps = {c["id"]: c for c in self.config()["components"]}
        return [comps[i].get("props", {}).get("value") for i in dep["inputs"]]

    def labels(self, api_name: str) -> list[str | None]:
        _, dep = self._dependency(api_name)
        comps = {c["id"]: c for c in self.config()["components"]}
        return [comps[i].get("props", {}).get("label") for i in dep["inputs"]]

    def join(self, api_name: str, data: list | None = None, **by_label) -> Job:
        """Queue an event for the endpoint with its start-up inputs, those named by label replaced."""
        fn_index, _ = self._dependency(api_name)
        data = list(self.defaults(api_name) if data is None else data)
        labels = self.labels(api_name)
        for label, value in by_label.items():
            data[labels.index(label)] = value
        return Job(self, fn_index, data)


def cpu_stops(app: Served, *, within: float = 10.0, window: float = 2.0, idle: float = 0.25) -> float | None:
    """Seconds until the server's CPU time grows by less than `idle` seconds over `window`, or None."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        before = app.cpu_seconds()
        time.sleep(window)
        if app.cpu_seconds() - before < idle:
            return time.monotonic() - start
    return None

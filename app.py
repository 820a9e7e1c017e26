"""kvplay: a playground for KV-cache quantization. Run `python app.py` and open http://127.0.0.1:7860."""
import os

from kvplay.app.settings import SPIN_COUNT  # imports no torch

os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)   # before torch starts its OpenMP threads: see SPIN_COUNT

from kvplay.ui.app import launch  # noqa: E402  (after the OpenMP setting above)

if __name__ == "__main__":
    launch()

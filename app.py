"""kvplay: a playground for KV-cache quantization. Run `python app.py` and open http://127.0.0.1:7860."""

from kvplay.app.settings import bound_openmp_spin  # imports no torch

bound_openmp_spin()              # before torch starts its OpenMP threads: see kvplay.app.settings.SPIN_COUNT

from kvplay.ui.app import launch  # noqa: E402  (after the OpenMP setting above)

if __name__ == "__main__":
    launch()

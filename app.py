"""kvplay: a playground for KV-cache quantization. Run `python app.py` and open http://127.0.0.1:7860."""
from kvplay.ui.app import launch

if __name__ == "__main__":
    launch()

"""Drives vLLM's own scheduler and KV-cache manager over a trace, compares with goldens.

Where things are, whatever module asks: the package's directory, its tiny model
configs, and the directory holding ``replayer/`` and ``traces/`` (a checkout's
root, or site-packages).
"""

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
MODELS_DIR = PACKAGE_DIR / "models"
SOURCE_ROOT = PACKAGE_DIR.parent

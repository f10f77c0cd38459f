"""Where the repository is, for the tests in every folder below tests/ (no other imports)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

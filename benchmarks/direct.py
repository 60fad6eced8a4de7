"""The tests' direct ModelRunner driver (tests/direct_driver.py: a row, slots and `req_to_token` entries
without a scheduler), for the forward benchmarks. It is test support, so it does not ship in the package."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from direct_driver import DirectDriver, DirectRequest  # noqa: E402

__all__ = ["DirectDriver", "DirectRequest"]

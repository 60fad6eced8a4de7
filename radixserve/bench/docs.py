"""What every benchmark shares: the CPU's name, and replacing its own marked section of docs/benchmarks.md."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_doc_section(path: str | Path, start: str, end: str, body: str) -> None:
    """Replace the text between the `start` and `end` markers of `path`, or append a new marked section."""
    path = Path(path)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = f"{start}\n{body.strip()}\n{end}"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        text = before + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)

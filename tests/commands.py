"""The ``antdt`` command, run as a user runs it: in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ANTDT = str(Path(sys.executable).parent / "antdt")


def antdt(*args: str, cwd: Path, check: bool = True,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``antdt ARGS`` in a process of its own (``env``: variables to add); its output on
    failure."""
    result = subprocess.run([ANTDT, *args], cwd=cwd, capture_output=True, text=True,
                            timeout=300, env={**os.environ, **(env or {})})
    if check:
        assert result.returncode == 0, f"antdt {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result

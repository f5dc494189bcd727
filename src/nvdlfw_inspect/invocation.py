"""How to run the ``nvdlfw-inspect`` command from this shell, for the commands a program prints as next steps:
after ``scripts/*.sh`` no PATH finds the bare name, so a printed ``nvdlfw-inspect ...`` would fail as written."""

from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path


def command(module: str = "nvdlfw_inspect.cli") -> str:
    """The bare name when the PATH finds this environment's command, else its path (``.venv/bin/nvdlfw-inspect``
    after the scripts, relative to the working directory when inside it), else ``module`` run by this interpreter."""
    script = Path(sys.executable).parent / "nvdlfw-inspect"
    found = shutil.which("nvdlfw-inspect")
    if found and Path(found).resolve() == script.resolve():
        return "nvdlfw-inspect"
    if not script.is_file():
        return f"{shlex.quote(sys.executable)} -m {module}"
    try:
        return shlex.quote(str(script.relative_to(Path.cwd())))
    except ValueError:
        return shlex.quote(str(script))

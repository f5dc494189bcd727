"""Open a page in headless Chromium: its DOM after the scripts ran, its console errors, a screenshot."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome") if shutil.which(name)), None)
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000"]


def run(page: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [CHROMIUM, *FLAGS, *extra, page.resolve().as_uri()]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def console_errors(stderr: str) -> list[str]:
    """Lines where the page's console reported an error or an exception went uncaught."""
    return [line for line in stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]


def dom(page: Path, width: int = 1300, height: int = 1800) -> tuple[str, list[str]]:
    result = run(page, "--dump-dom", f"--window-size={width},{height}")
    return result.stdout, console_errors(result.stderr)


def screenshot(page: Path, out: Path, width: int = 1300, height: int = 1800) -> list[str]:
    result = run(page, f"--screenshot={out}", f"--window-size={width},{height}")
    return console_errors(result.stderr)

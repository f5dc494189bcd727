"""Log faults on real file systems, not fault-injecting stand-ins: a small tmpfs mounted as one log directory
runs out of space while the others have room (needs root to mount; skipped otherwise)."""

from __future__ import annotations

import json
import os
import subprocess
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from logreader import stats_log_path, stats_records_path

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.cli import main
from nvdlfw_inspect.logging import MetricLogger
from nvdlfw_inspect.reading import LostRecordsWarning, iter_statistics

CONFIG = {
    "s": {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": ".*"},
        "LogTensorStats": {"enabled": True, "stats": ["min", "max", "mean", "std"], "tensors": ["activation"]},
    }
}
ITERATIONS = 40


@pytest.fixture
def small_disk():
    """Mounts a 4 KiB tmpfs at the path it is given (made if need be), unmounted at the test's end if the test did
    not unmount it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted: list[Path] = []

    def mount(path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(path)], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        if os.path.ismount(path):
            subprocess.run(["umount", str(path)], check=True)


def train(log_dir: Path, one_by_one: bool = False) -> None:
    """40 iterations of 4 statistics: through step() (a step's records in one write), or each statistic logged
    and written alone (``MetricLogger.log_statistic``), so that the records can stop in the middle of a step."""
    debug_api.initialize(CONFIG, log_dir=log_dir)
    for step in range(ITERATIONS):
        if one_by_one:
            for stat in ("min", "max", "mean", "std"):
                MetricLogger.log_statistic("model.fc_1", "activation", stat, step / 3, step)
        else:
            debug_api.log_tensor_stats("model.fc_1", tensor=torch.tensor([-1.0, float(step)]), tensor_name="activation")
        debug_api.step()
    debug_api.end_debug()


@pytest.mark.parametrize("one_by_one", [False, True], ids=["steps", "one_by_one"])
def test_records_lost_to_a_full_records_directory_are_said_and_read_from_the_text_log(log_dir, small_disk, capsys, one_by_one):
    """The records' directory holds a few steps' records; the text log has room: every iteration is read, with
    one warning naming the records file, how many records were lost, why, and what to do."""
    small_disk(stats_records_path(log_dir).parent)
    train(log_dir, one_by_one)  # raises nothing into the training
    assert "No space left on device" in capsys.readouterr().err
    written = Counter(json.loads(line)["iteration"] for line in stats_records_path(log_dir).read_text().splitlines())
    lost = 4 * ITERATIONS - sum(written.values())
    assert 0 < lost < 4 * ITERATIONS  # the tmpfs kept some steps' records only
    assert (set(written.values()) != {4}) is one_by_one  # one by one, the records stop in the middle of a step
    assert len(stats_log_path(log_dir).read_text().splitlines()) == 4 * ITERATIONS  # the text log is whole

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        per_step = Counter(s.iteration for s in iter_statistics(log_dir))
    assert per_step == dict.fromkeys(range(ITERATIONS), 4)
    assert len({(s.iteration, s.stat) for s in iter_statistics(log_dir)}) == 4 * ITERATIONS  # none twice
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and caught[0].category is LostRecordsWarning
    assert f"{stats_records_path(log_dir)}: {lost} statistics records were lost" in said[0]
    assert "No space left on device" in said[0] and str(stats_log_path(log_dir)) in said[0]

    assert main(["report", str(log_dir), "--output", str(log_dir / "report.html")]) == 0
    err = capsys.readouterr().err
    assert err.count(f"{lost} statistics records were lost") == 1


def test_a_later_run_that_loses_nothing_is_read_without_the_earlier_runs_warning(log_dir, small_disk):
    """The next run in the log_dir truncates the logs, and with them the note of what the earlier run lost."""
    records = small_disk(stats_records_path(log_dir).parent)
    train(log_dir)
    subprocess.run(["umount", str(records)], check=True)
    train(log_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Counter(s.iteration for s in iter_statistics(log_dir)) == dict.fromkeys(range(ITERATIONS), 4)


def test_a_log_dir_too_full_for_the_note_of_the_losses_says_so_at_end_debug(log_dir, small_disk, capsys):
    """The whole log_dir on 4 KiB, which the debug log fills: the statistics and the note of their loss cannot be
    written, the training goes on, and end_debug says both."""
    small_disk(log_dir)
    train(log_dir)
    err = capsys.readouterr().err
    note = log_dir / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.losses.json"
    assert f"{4 * ITERATIONS} in {stats_records_path(log_dir)}" in err
    assert f"the count of the statistics lost could not be written to {note} ([Errno 28] No space left on device)" in err

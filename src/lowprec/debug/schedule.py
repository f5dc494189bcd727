"""When a scheduled feature runs: ``freq``, ``start_step``, ``end_step`` and ``start_end_list`` of the
``transformer_engine`` statistics features, and the next iteration it will run at."""

from __future__ import annotations

import math


def next_enabled_iter(
    start_step: int | None,
    end_step: int | None,
    start_end_list: list[list[int]] | None,
    freq: int,
    iteration: int,
) -> tuple[bool, int | None]:
    """``(runs at iteration, next iteration it runs at or None)``.

    Windows are closed ``[start, end]``; ``start_end_list`` replaces ``start_step``/``end_step``; an end
    of -1 or None means no end. ``freq`` counts absolute iterations (start 1, freq 3: 3, 6, 9, ...).
    """
    windows = _windows(start_step, end_step, start_end_list)
    runs = iteration % freq == 0 and any(s <= iteration <= e for s, e in windows)
    for start, end in windows:
        low = max(iteration + 1, start)
        candidate = -(-low // freq) * freq
        if candidate <= end:
            return runs, candidate
    return runs, None


def every_iteration_from(
    start_step: int | None, end_step: int | None, start_end_list: list[list[int]] | None, freq: int, iteration: int
) -> bool:
    """Whether the schedule runs at ``iteration`` and at every iteration after it (``freq`` 1, in a window with no
    end): its answer need not be asked again."""
    return freq == 1 and any(
        start <= iteration and end == math.inf for start, end in _windows(start_step, end_step, start_end_list)
    )


def _windows(start_step: int | None, end_step: int | None, start_end_list: list[list[int]] | None) -> list[tuple[int, float]]:
    """The schedule's closed windows ``(start, end)``, sorted, an end of -1 or None as infinity."""
    if start_end_list:
        return sorted((s, math.inf if e in (-1, None) else e) for s, e in start_end_list)
    return [(start_step or 0, math.inf if end_step in (-1, None) else end_step)]

"""Logging windows: whether a statistic scheduled by a feature's step keys is logged at this step."""

from __future__ import annotations


def enable_logging_at_current_step(
    cur_step: int,
    freq: int = 1,
    start_step: int = 0,
    end_step: int = -1,
    start_end_list: list[list[int]] | None = None,
) -> bool:
    """Whether a statistic scheduled by these keys is logged at ``cur_step``.

    ``start_end_list`` windows are half-open ``[start, end)`` (end -1: no end) and override
    ``start_step``/``end_step``, whose window is closed ``[start_step, end_step]``. ``freq`` counts
    absolute steps, not steps since the start.
    """
    if freq <= 0:
        raise ValueError(f"freq must be a positive integer, got {freq!r}")
    if cur_step % freq != 0:
        return False
    if start_end_list:
        return any(cur_step >= start and (end == -1 or cur_step < end) for start, end in start_end_list)
    return cur_step >= start_step and (end_step == -1 or cur_step <= end_step)

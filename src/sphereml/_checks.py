"""Argument checks shared by the modules: one clear ``ValueError`` per bad number."""

from __future__ import annotations

import math


def real_number(name: str, value, *, at_least: float | None = None, above: float | None = None,
                below: float | None = None) -> float:
    """``value`` as a float if it is a finite real number within the given bounds (bool is refused)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (at_least is None or value >= at_least) and (above is None or value > above)
    ok = ok and (below is None or value < below)
    if not ok:
        bounds = [f">= {at_least:g}" if at_least is not None else "", f"> {above:g}" if above is not None else "",
                  f"< {below:g}" if below is not None else ""]
        bounds_text = " and ".join(b for b in bounds if b)
        raise ValueError(f"{name} must be a finite number{' ' + bounds_text if bounds_text else ''}, got {value!r}")
    return float(value)

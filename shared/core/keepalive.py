"""Keep-alive of an instance (Ollama's semantics): how long it stays loaded once idle.

A model is registered with a keep-alive (None: the core's `CoreConfig.keep_alive_s`) and a
minimum of warm instances (`min_instances`, pinning); a request may carry its own `keep_alive`,
which becomes its instance's window from its admission on (the last request's wins, as in
Ollama). A window of 0 unloads the instance as soon as it is idle; a negative one never does.
An instance of a pinned model is never reclaimed as idle (its node knows only itself, so "never
below the minimum" is kept by never reclaiming any of them; the memory stays counted).
"""

from __future__ import annotations

import math
import re

from shared.core.types import InstanceStatus, InstanceView, NodeView

FOREVER = -1.0  # the canonical "never reclaim" window (any negative value means that)

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h)")


def parse_keep_alive(value: object) -> float:
    """Seconds from a keep-alive as Ollama takes it: a number of seconds, or a string holding a
    number ("300") or a duration ("5m", "1h30m", "30s", "250ms"), optionally negative. Negative
    means never (returned as `FOREVER`). ValueError on anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"keep_alive must be a number of seconds or a duration like '5m', "
                         f"got {value!r}")
    if isinstance(value, str):
        seconds = _parse_text(value)
    else:
        seconds = float(value)
    if math.isnan(seconds) or math.isinf(seconds) and seconds > 0:
        raise ValueError(f"keep_alive must be finite (negative: never unload), got {value!r}")
    return FOREVER if seconds < 0 else seconds


def _parse_text(text: str) -> float:
    body = text.strip()
    sign = -1.0 if body.startswith("-") else 1.0
    body = body.lstrip("+-")
    try:
        return sign * float(body)
    except ValueError:
        pass
    if not body or _DURATION.sub("", body):
        raise ValueError(f"keep_alive must be a number of seconds or a duration like '5m', "
                         f"'1h30m', '30s', got {text!r}")
    return sign * sum(float(n) * _UNITS[u] for n, u in _DURATION.findall(body))


def window(inst: InstanceView, default_s: float) -> float | None:
    """The instance's idle window in seconds; None: it is never reclaimed as idle (pinned, or a
    negative keep-alive)."""
    if inst.pinned:
        return None
    s = default_s if inst.keep_alive_s is None else inst.keep_alive_s
    return None if s < 0 else s


def expires_at(inst: InstanceView, default_s: float) -> float | None:
    """When an idle instance's keep-alive runs out (None: never)."""
    w = window(inst, default_s)
    return None if w is None else inst.last_active + w


def is_idle(inst: InstanceView) -> bool:
    return inst.status is InstanceStatus.READY and not inst.requests


def expired(inst: InstanceView, now: float, default_s: float) -> bool:
    """Idle and past its keep-alive. Expiry is compared as `now >= last_active + window`, the
    sum `next_reclaim_at` announces: at that very time `now - last_active` can round below the
    window (0.4 + 1.0 - 0.4 < 1.0), and a caller woken then would find nothing to reclaim."""
    at = expires_at(inst, default_s)
    return is_idle(inst) and at is not None and now >= at


def instance_window(request_keep_alive_s: float | None, model_keep_alive_s: float | None) -> float | None:
    """An instance's window after admitting a request: the request's keep-alive, else its
    model's registered one (None: the core's default)."""
    return request_keep_alive_s if request_keep_alive_s is not None else model_keep_alive_s


def pin_shortfall(minimums: dict[str, int], nodes: list[NodeView]) -> dict[str, int]:
    """How many instances each pinned model (`minimums`: name -> min_instances) lacks in the
    cluster: its instances that serve or will (loading, ready; not leaving) on nodes that take
    work (not draining) count. Models at or above their minimum are left out."""
    have = {name: 0 for name in minimums}
    for node in nodes:
        if node.draining:
            continue
        for inst in node.instances:
            if inst.model.name in have and inst.accepts:
                have[inst.model.name] += 1
    return {name: minimums[name] - n for name, n in have.items() if n < minimums[name]}

"""What an operator sees: per-partition state, per-dependency status, and the stall watch.

A partition is `breached` while a payment on it has waited at the gate longer than AML_MAX_WAIT: the
service is then past its bound (shown on the page, by `aml-app status` and as a metric), whatever the
dependencies' statuses say.

Pure functions over the watermark table's rows (and who waits where), so the web page, `/metrics` and
`aml-app status` show the same thing and every rule is unit-tested. The rules, in order of precedence:

- `error`: the last refresh failed (every number is the last one known), or the leader's rows do not
  count the group (the leader runs with another AML_DEPENDS_ON, as in a rolling restart).
- `unknown group`: the group has no committed offset on any partition (a wrong name, or never started).
- `stalled`: on some partition a payment waits at offset w, the group's committed offset is <= w (it
  holds that payment back) and it has not advanced for `stall_after` seconds.
- `lagging`: on some partition the group is more than `lag_warn` records behind the log end, or it is
  behind the log end and has not advanced for `stall_after` seconds (nobody waits on it: yet).
- `ok`: otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aml_app.gate.watermark import WatermarkRow
from aml_app.settings import GateSettings

OK, LAGGING, STALLED, UNKNOWN_GROUP, ERROR = "ok", "lagging", "stalled", "unknown group", "error"
STATUSES = (OK, LAGGING, STALLED, UNKNOWN_GROUP, ERROR)


@dataclass(frozen=True)
class Limits:
    """When a dependency stops being `ok` (AML_STALL_AFTER, AML_LAG_WARN)."""

    stall_after: float = 30.0
    lag_warn: int = 1000
    #: AML_MAX_WAIT: a partition whose payment has waited longer is `breached`.
    max_wait: float = 300.0

    @classmethod
    def of(cls, gate: GateSettings) -> Limits:
        """The limits a deployment's gate settings set: every view reads the same three."""
        return cls(stall_after=gate.stall_after, lag_warn=gate.lag_warn, max_wait=gate.max_wait)


def bottleneck(dependencies: Mapping[str, int]) -> list[str]:
    """The groups with the lowest committed offset on a partition (all of them on a tie)."""
    if not dependencies:
        return []
    low = min(dependencies.values())
    return [g for g, c in dependencies.items() if c == low]


def payments_waiting(log_end: int | None, watermark: int, service_committed: int | None) -> int | None:
    """Payments in the log that the gate holds back: offsets in [max(W, our commit), log end)."""
    if log_end is None:
        return None
    return max(0, log_end - max(watermark, service_committed or 0))


def partition_view(
    row: WatermarkRow,
    *,
    waiting_offset: int | None = None,
    blocked_since: float | None = None,
    in_flight: int | None = None,
    local: bool = False,
    highwater: int | None = None,
    untrusted: str | None = None,
) -> dict[str, Any]:
    """One partition as the operator views show it (docs/operating.md has every field)."""
    known = [x for x in (row.log_end, highwater) if x is not None]
    log_end = max(known) if known else None
    deps: dict[str, int] = dict(row.dependencies)
    return {
        "partition": row.partition,
        "log_end": log_end,
        "service_committed": row.service_committed,
        "in_flight": in_flight,
        "local": local,
        "dependencies": deps,
        "dependency_lag": {g: None if log_end is None else max(0, log_end - c) for g, c in deps.items()},
        "never_committed": list(row.never_committed),
        "advanced_at": dict(row.advanced_at),
        "watermark": row.watermark,
        "lag": None if log_end is None else max(0, log_end - row.watermark),
        "payments_waiting": payments_waiting(log_end, row.watermark, row.service_committed),
        "waiting_offset": waiting_offset,
        "blocked_since": blocked_since,
        "bottleneck": bottleneck(deps),
        "refreshed_at": row.refreshed_at,
        "generation": row.generation,
        "log": row.log,
        "untrusted": untrusted,
        "error": row.error,
    }


def _held(part: Mapping[str, Any]) -> bool:
    """Whether the gate holds payments back on this partition (one waits, or some lie past W)."""
    return part["waiting_offset"] is not None or bool(part["payments_waiting"])


def _stalled_on(group: str, part: Mapping[str, Any], now: float, limits: Limits) -> bool:
    waiting, advanced = part["waiting_offset"], part["advanced_at"].get(group)
    return (
        waiting is not None
        and group in part["dependencies"]
        and part["dependencies"][group] <= waiting
        and advanced is not None
        and now - advanced >= limits.stall_after
    )


def _lagging_on(group: str, part: Mapping[str, Any], now: float, limits: Limits) -> bool:
    lag, advanced = part["dependency_lag"].get(group), part["advanced_at"].get(group)
    if lag is None or lag == 0:
        return False
    return lag > limits.lag_warn or (advanced is not None and now - advanced >= limits.stall_after)


def plural_partitions(parts: Sequence[int]) -> str:
    """[0] -> 'partition 0', [0, 2] -> 'partitions 0, 2'."""
    return ("partition " if len(parts) == 1 else "partitions ") + ", ".join(str(p) for p in parts)


def cut_closed(cut: Mapping[str, Any] | None) -> bool:
    """Whether the event-time cut of an operator view (`cut_view`) keeps the gate shut everywhere: this
    worker distrusts it, or it could not read a partition."""
    return bool(cut and (cut.get("untrusted") or cut.get("unread")))


def dependency_view(
    group: str, parts: Sequence[Mapping[str, Any]], now: float, limits: Limits, error: str | None = None
) -> dict[str, Any]:
    """One dependency group's status, with the partitions behind it and a sentence saying why."""
    stalled = [p["partition"] for p in parts if _stalled_on(group, p, now, limits)]
    lagging = [p["partition"] for p in parts if _lagging_on(group, p, now, limits)]
    lags = [p["dependency_lag"].get(group) for p in parts]
    advanced = [t for p in parts if (t := p["advanced_at"].get(group)) is not None]
    last_advance = max(advanced) if advanced else None
    uncounted = [p["partition"] for p in parts if group not in p["dependencies"]]
    if error:
        status, detail = ERROR, f"the last offset refresh failed ({error}); showing the last known offsets"
    elif uncounted:
        status, detail = (
            ERROR,
            f"the leader's rows do not count this group on {plural_partitions(uncounted)} (the leader runs "
            "with another AML_DEPENDS_ON): this worker's gate stays closed there",
        )
    elif all(group in p["never_committed"] for p in parts):
        status, detail = UNKNOWN_GROUP, "no committed offset on any partition: is the group name right?"
    elif stalled:
        held = [p for p in parts if p["partition"] in stalled]
        quiet = min(now - p["advanced_at"][group] for p in held)
        waits = ", ".join(f"{p['partition']}:{p['waiting_offset']}" for p in held)
        status = STALLED
        detail = (
            f"not advanced for {quiet:.0f} s on {plural_partitions(stalled)} while payments wait ({waits})"
        )
    elif lagging:
        worst = max(lag for lag in lags if lag is not None)
        status, detail = (
            LAGGING,
            f"behind the log end on {plural_partitions(lagging)} (up to {worst} records)",
        )
    else:
        status = OK
        detail = "caught up" if all(lag == 0 for lag in lags) else "keeping up"
    return {
        "group": group,
        "status": status,
        "detail": detail,
        "lag": None if not lags or any(lag is None for lag in lags) else sum(lags),
        "last_advance": last_advance,
        "stalled_partitions": stalled,
        "lagging_partitions": lagging,
        "holding_back": [p["partition"] for p in parts if group in p["bottleneck"] and _held(p)],
        "committed": {str(p["partition"]): p["dependencies"].get(group) for p in parts},
    }


def describe(
    rows: Mapping[int, WatermarkRow],
    groups: Sequence[str],
    now: float,
    limits: Limits,
    *,
    waiting: Mapping[int, int] | None = None,
    blocked_since: Mapping[int, float] | None = None,
    in_flight: Mapping[int, int | None] | None = None,
    local: Collection[int] = (),
    highwaters: Mapping[int, int | None] | None = None,
    untrusted: Mapping[int, str | None] | None = None,
) -> dict[str, Any]:
    """The operator view of the whole table: `partitions`, `dependencies` and `gate`. `untrusted` says
    why a partition's row keeps this worker's gate closed whatever its watermark."""
    waiting, blocked_since = waiting or {}, blocked_since or {}
    in_flight, highwaters, untrusted = in_flight or {}, highwaters or {}, untrusted or {}
    parts = [
        partition_view(
            rows[p],
            waiting_offset=waiting.get(p),
            blocked_since=blocked_since.get(p),
            in_flight=in_flight.get(p),
            local=p in local,
            highwater=highwaters.get(p),
            untrusted=untrusted.get(p),
        )
        for p in sorted(rows)
    ]
    for part in parts:
        since = part["blocked_since"]
        part["waited_s"] = None if since is None else round(max(0.0, now - since), 3)
        part["breached"] = part["waited_s"] is not None and part["waited_s"] >= limits.max_wait
    waited = [part["waited_s"] for part in parts if part["waited_s"] is not None]
    errors = [(r.error_at or 0.0, r.error) for r in rows.values() if r.error]
    error_at, error = max(errors) if errors else (None, None)
    newest = max((r.refreshed_at for r in rows.values()), default=None)
    waits = [p["payments_waiting"] for p in parts]
    return {
        "partitions": parts,
        # No row yet: nothing is known of any group (not "unknown group", which blames its name).
        "dependencies": [dependency_view(g, parts, now, limits, error) for g in groups] if parts else [],
        "gate": {
            "refresh_age_s": None if newest is None else round(max(0.0, now - newest), 3),
            "admin_error": error,
            "admin_error_at": error_at,
            "blocked_partitions": sorted(p["partition"] for p in parts if p["waiting_offset"] is not None),
            "untrusted_partitions": sorted(p["partition"] for p in parts if p["untrusted"]),
            "payments_waiting": None if any(w is None for w in waits) else sum(waits),
            "stall_after_s": limits.stall_after,
            "lag_warn": limits.lag_warn,
            "max_wait_s": limits.max_wait,
            "longest_wait_s": max(waited) if waited else None,
            "breached_partitions": [part["partition"] for part in parts if part["breached"]],
        },
    }


class StallWatch:
    """Turns the computed statuses into log lines: a warning when a group's stall starts (naming the
    group and its partitions), an info line when it ends. Nothing is logged while nothing changes."""

    def __init__(self) -> None:
        self.stalled: dict[str, list[int]] = {}

    def update(self, dependencies: Sequence[Mapping[str, Any]]) -> list[tuple[int, str]]:
        """The (level, message) lines this change of statuses calls for."""
        lines: list[tuple[int, str]] = []
        now_stalled = {
            d["group"]: list(d["stalled_partitions"]) for d in dependencies if d["status"] == STALLED
        }
        statuses = {d["group"]: d["status"] for d in dependencies}
        for group, parts in now_stalled.items():
            if group not in self.stalled:
                detail = next(d["detail"] for d in dependencies if d["group"] == group)
                lines.append(
                    (
                        logging.WARNING,
                        f"dependency group {group!r} stalled on {plural_partitions(parts)}: {detail}",
                    )
                )
        for group, parts in self.stalled.items():
            if group not in now_stalled:
                status = statuses.get(group, "gone")
                lines.append(
                    (
                        logging.INFO,
                        f"dependency group {group!r} no longer stalled on {plural_partitions(parts)} "
                        f"(now {status})",
                    )
                )
        self.stalled = now_stalled
        return lines

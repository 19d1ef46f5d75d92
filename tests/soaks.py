"""Running a chaos soak (`bench.chaos_soak`) from a test: the results written and printed, the verdict
reached."""

from __future__ import annotations

import json

from bench.chaos_soak import Options, Soak, summary, write


async def soaked(options: Options, shown: tuple[str, ...]) -> dict:
    """Run the soak, write and print its results; it ran to its verdict."""
    doc = await Soak(options).run()
    write(doc, options.results)
    print(summary(doc))
    print(json.dumps({k: doc.get(k) for k in shown}, indent=2, default=str))
    assert not doc.get("error"), doc.get("error")
    return doc


def injected(doc: dict) -> list[str]:
    """The faults injected without an error, sorted."""
    return sorted(x["kind"] for x in doc["faults"] if x["started_at_s"] is not None and not x["error"])

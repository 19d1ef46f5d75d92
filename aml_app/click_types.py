"""Option types the commands share."""

from __future__ import annotations

import math

import click


class FiniteRange(click.FloatRange):
    """A `click.FloatRange` that refuses nan and infinity: click lets nan through any range (every
    comparison with it is false), and infinity through one without a bound, and both end in a traceback
    or a run that never ends."""

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number: float = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


#: A positive finite number: a rate, a duration, a count of days.
POSITIVE = FiniteRange(min=0, min_open=True)
#: A command's deadline in seconds: zero or less would be none (aiohttp's and aiokafka's reading).
TIMEOUT = FiniteRange(min=0, min_open=True, max=600)

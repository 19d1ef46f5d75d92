"""The start of a script that runs the leader's watermark refresh in a fresh interpreter (importing the
tables builds the app): a leader of generation 3 on a fake clock, its tables plain dicts as the changelog
would carry them, read through `rows_of` and `cut_of` as every worker's views read them. The script
replaces `gate.offsets.read_all` and `gate.unapplied.read` with its reads."""

LEADER = """
import asyncio, json, logging, os, time
from aml_app.gate.event_time import Unapplied
from aml_app.kafka.offsets import OffsetReadError, Reading
from aml_app.tables import watermarks as w
from aml_app.views.status import health_code

clock = [1000.0]
time.time = lambda: clock[0]
w.app.is_leader = lambda: True
w.app.consumer_generation_id = 3
gate = w.gate_service()
gate.changelogs.known = True
w.watermarks, w.cuts = {}, {}
w.rows_of.table, w.cut_of.table = w.watermarks, w.cuts
groups = w.settings.depends_on
"""

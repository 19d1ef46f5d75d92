"""Faust tables: the watermark table that every worker reads, and the gate's demand table."""

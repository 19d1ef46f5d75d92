"""Freshness-gated stream processing for payments (Service-A, AML detection)."""

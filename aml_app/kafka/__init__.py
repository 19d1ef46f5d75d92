"""Kafka plumbing: the topics and their settings, TLS/SASL, small client helpers, the embedded broker."""

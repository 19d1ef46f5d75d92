"""The development harness: the whole system as local processes (embedded broker and PostgreSQL,
the pipeline, the APIs, the workers), the demo and its checks. Tests, benchmarks and `aml-app demo` use
it; a production image never imports it (tests/unit/test_import_rules.py)."""

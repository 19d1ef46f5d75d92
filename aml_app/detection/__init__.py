"""Detection rules of Service-A (AML) and Service-A1 (fraud): pure functions of gated evidence."""

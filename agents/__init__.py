"""Faust agents: gated services consuming the payments topic."""

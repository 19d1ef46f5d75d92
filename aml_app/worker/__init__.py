"""A Faust worker's wiring: the gated agent of its service and the detecting services' handler.

These modules build on the Faust app (`aml_app.app`) and its tables; the gate, the rules and the
dependency clients they wire together know nothing of Faust's app.
"""

"""Training the AML model: the reference of Services B and C replayed over a labelled history, the fit, the
split into what training reads and what only scoring reads, and `aml-app train-model`."""

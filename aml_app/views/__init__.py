"""What operators see: the web view of the watermark table, its JSON, the metrics, `aml-app status`."""

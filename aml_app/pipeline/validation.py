"""STAND-IN (replaced by the Spark SQL contract): validation through the Python contract in mapInArrow."""

from __future__ import annotations

from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from aml_app.pipeline.parse import PARSED_SCHEMA, payment_parser


def validated(records: DataFrame, max_bytes: int) -> DataFrame:
    parsed = records.mapInArrow(payment_parser(max_bytes), PARSED_SCHEMA)
    raw = records.select("partition", "offset", "key", "value")
    joined: Any = parsed.drop("key", "value").join(raw, ["partition", "offset"])
    return joined.select(
        "partition",
        "offset",
        "key",
        "value",
        F.col("error").isNull().alias("valid"),
        "payment_id",
        "payer",
        "payee",
        F.col("amount").cast("decimal(19,4)").alias("amount"),
        "currency",
        "ts",
    )

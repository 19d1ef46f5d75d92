"""Services B (relations) and C (aggregates): PostgreSQL stores written by Spark, read by HTTP APIs."""

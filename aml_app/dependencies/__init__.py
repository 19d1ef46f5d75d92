"""Services B (relations) and C (aggregates): SQLite stores written by Spark, read by HTTP APIs."""

"""Services B and C on Spark: the Kafka source, the contract in SQL, the micro-batch jobs and their runner."""

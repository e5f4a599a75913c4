"""Engine kinds the supervisor manages: how each is started, probed and ended.

- ``failover``: the bundled engine, forked from the zygote, one process (its tensor-parallel ranks
  are its children and die with it); ``/ready`` once its weights are mapped and warmed; its KV pool
  is resized at promotion (failover.node.kv_pools).
- ``vllm``: vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``), a process tree
  (API server, ``VLLM::EngineCore``, ``VLLM::Worker``s, multiprocessing's resource tracker) watched
  and ended as one unit (failover.procs.tree); ``/health`` is both its readiness and its liveness
  (the server listens only once its engine core is up); its KV pool is fixed for the life of the
  process, so a standby gets ``standby_kv_memory`` when one is set and the full ``kv_memory``
  otherwise (a vLLM standby cannot grow at promotion). With ``weights = "cache"`` (the default) it
  maps its weights from the node's cache daemon (``--load-format failover``, failover_vllm), which
  then packs vLLM's own layout; ``weights = "disk"``: vLLM reads the checkpoint itself.

The router's side of a kind (probe path, how a stream is resumed) is ``router.adapters``; the name
is the same.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from failover.config.schema import Config, ServiceConfig


@dataclass(frozen=True, slots=True)
class EngineKind:
    name: str
    ready_path: str  # 200 once it serves (the supervisor's launch wait)
    probe_path: str  # the router's liveness probe
    tree: bool  # a process tree, ended as one (failover.procs.tree.TreeChild)
    resizable_kv: bool  # answers /admin/kv (pool grown at promotion, shrunk back as a standby)


FAILOVER = EngineKind("failover", ready_path="/ready", probe_path="/ready", tree=False, resizable_kv=True)
VLLM = EngineKind("vllm", ready_path="/health", probe_path="/health", tree=True, resizable_kv=False)
KINDS = {k.name: k for k in (FAILOVER, VLLM)}


def kind_of(svc: ServiceConfig) -> EngineKind:
    return KINDS[svc.engine]


def vllm_kv_bytes(svc: ServiceConfig, *, primary: bool) -> int:
    """A vLLM instance's KV pool: fixed at start (see the module docstring)."""
    if primary or svc.kind == "batch" or svc.standby_kv_memory_bytes is None:
        return svc.kv_memory_bytes
    return svc.standby_kv_memory_bytes


def vllm_env(config: Config, svc: ServiceConfig) -> dict[str, str]:
    """The environment of a vLLM instance: ours, plus ``engine_env``. On CPU, vLLM's default
    (``VLLM_CPU_OMP_THREADS_BIND=auto``) pins every instance's worker to the same cores, so a
    primary, its standby and a relaunch would share one core while the others idle: we ask for
    ``nobind`` unless ``engine_env`` says otherwise (give each service its cores there)."""
    env = dict(os.environ, FAILOVER_VLLM_DIE_WITH_PARENT="1")  # failover_vllm.plugin
    if config.model.device == "cpu":
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env | svc.engine_env


def vllm_argv(config: Config, svc: ServiceConfig, port: int, kv_bytes: int, report=None) -> list[str]:
    """vLLM's OpenAI server for one instance; ``engine_args`` last, as the operator wrote them.
    ``report``: where the model loader writes where its weights came from (weights_report)."""
    m = config.model
    python = svc.engine_python or sys.executable
    cap = ["--max-model-len", str(svc.max_model_len)] if svc.max_model_len else []
    weights = []
    if svc.weights == "cache":  # failover_vllm.model_loader; no daemon is an error, never a silent disk load
        extra = {"socket": str(config.daemon_socket), "cpu_gemm": svc.cpu_gemm}
        extra |= {"report": str(report)} if report else {}
        weights = ["--load-format", "failover", "--model-loader-extra-config", json.dumps(extra)]
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", m.path,
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", svc.name,
            "--dtype", m.dtype, "--tensor-parallel-size", str(m.tp), "--max-num-seqs", str(svc.max_batch),
            "--kv-cache-memory-bytes", str(kv_bytes), *weights, *cap, *svc.engine_args]


def maps_daemon(svc: ServiceConfig) -> bool:
    """Whether ``svc``'s engines map the cache daemon's weights: ours (and a ``command`` engine,
    which may be given the daemon's socket), and vLLM with ``weights = "cache"``."""
    return svc.engine == "failover" or svc.weights == "cache"


def needs_cache(config: Config, svc: ServiceConfig | None = None) -> bool:
    """Whether the node (or ``svc``) needs the cache daemon (:func:`maps_daemon`)."""
    return any(maps_daemon(s) for s in (config.service if svc is None else [svc]))


def needs_zygote(config: Config) -> bool:
    """Engines of ours fork from the zygote; a node of vLLM services only starts none."""
    return any(s.engine == "failover" for s in config.service)


def weights_report(config: Config, slot_name: str):
    """The file a vLLM instance's model loader writes once its weights are in place (failover_vllm)."""
    return config.run_path / f"{slot_name}.weights.json"


def read_weights_report(path, svc: ServiceConfig) -> dict:
    """What the instance reported (then the file is removed). vLLM's own loader (``weights =
    "disk"``) writes none: ``disk``; a ``cache`` instance that wrote none is ``unknown``, not guessed."""
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        return {"weights_source": "disk" if svc.weights == "disk" else "unknown (no report from the model loader)"}
    except ValueError as e:
        return {"weights_source": f"unknown (bad report: {e})"}
    finally:
        path.unlink(missing_ok=True)
    return {"weights_source": info.get("source", "unknown"), "weights": info}

"""Engine kinds the supervisor manages: how each is started, probed and ended.

- ``failover``: the bundled engine, forked from the zygote, one process (its tensor-parallel ranks
  are its children and die with it); ``/ready`` once its weights are mapped and warmed; its KV pool
  is resized at promotion (failover.node.kv_pools).
- ``vllm``: vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``), a process tree
  (API server, ``VLLM::EngineCore``, ``VLLM::Worker``s, multiprocessing's resource tracker) watched
  and ended as one unit (failover.procs.tree); ``/health`` is both its readiness and its liveness
  (the server listens only once its engine core is up); its KV pool is fixed for the life of the
  process, so a standby gets ``standby_kv_memory`` when one is set and the full ``kv_memory``
  otherwise (a vLLM standby cannot grow at promotion).

The router's side of a kind (probe path, how a stream is resumed) is ``router.adapters``; the name
is the same.
"""

from __future__ import annotations

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


def vllm_argv(config: Config, svc: ServiceConfig, port: int, kv_bytes: int) -> list[str]:
    """vLLM's OpenAI server for one instance; ``engine_args`` last, as the operator wrote them."""
    m = config.model
    python = svc.engine_python or sys.executable
    cap = ["--max-model-len", str(svc.max_model_len)] if svc.max_model_len else []
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", m.path,
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", svc.name,
            "--dtype", m.dtype, "--tensor-parallel-size", str(m.tp), "--max-num-seqs", str(svc.max_batch),
            "--kv-cache-memory-bytes", str(kv_bytes), *cap, *svc.engine_args]


def needs_cache(config: Config, svc: ServiceConfig | None = None) -> bool:
    """Whether the node (or ``svc``) runs engines of ours (or a ``command`` engine, which may be
    given the daemon's socket), which map the cache daemon's weights and fork from the zygote; a node
    of vLLM services only starts neither."""
    services = config.service if svc is None else [svc]
    return any(s.engine == "failover" for s in services)

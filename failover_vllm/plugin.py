"""failover's vLLM general plugin (entry point group ``vllm.general_plugins``, see pyproject.toml).

vLLM loads general plugins in every one of its processes: the API server, ``VLLM::EngineCore``, each
``VLLM::Worker``. Under failover's supervisor (``FAILOVER_VLLM_DIE_WITH_PARENT=1`` in the environment
the supervisor gives a vLLM instance, failover.node.engine_kinds.vllm_env) each of them asks the
kernel for SIGKILL when its parent dies. vLLM's engine core does not notice its API server's death on
its own, so without this a SIGKILLed supervisor (whose death kills the API server through its own
PR_SET_PDEATHSIG) would leave the engine core and its workers running, holding the instance's
memory. vLLM starts those children from its main thread, as the kernel's per-thread parent-death
signal requires. Outside failover (the variable unset) the plugin does nothing.
"""

from __future__ import annotations

import logging
import os
import signal

from failover_common.proc import die_with_parent

log = logging.getLogger(__name__)
ENV = "FAILOVER_VLLM_DIE_WITH_PARENT"
_registered = False


def register() -> None:
    """vLLM's plugin hook; idempotent (vLLM may call it more than once per process)."""
    global _registered
    if os.environ.get(ENV) == "1":
        die_with_parent(signal.SIGKILL)
    if _registered:
        return
    _registered = True
    from failover_vllm.detokenizer import install

    if not install():
        log.warning("failover could not fix this vLLM's detokenizer: a stream migrated where a character "
                    "was split may begin with its prompt's text (vllm-project/vllm#48853)")
    try:
        from vllm.model_executor.model_loader import register_model_loader

        from failover_vllm.model_loader import LOAD_FORMAT, FailoverModelLoader
    except ImportError as e:  # another vLLM than the loader is written for: vLLM itself still runs
        log.warning("failover's --load-format failover is unavailable with this vLLM (%s); "
                    "weights = \"disk\" still works", e)
        return
    register_model_loader(LOAD_FORMAT)(FailoverModelLoader)

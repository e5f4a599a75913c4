"""``--load-format failover``: vLLM maps its weights from failover's cache daemon instead of reading them.

Registered by the plugin (failover_vllm.plugin) in every vLLM process. Options, as
``--model-loader-extra-config '{"socket": "/tmp/failover-1000/daemon.sock", ...}'``:

- ``socket`` (required): the daemon's socket.
- ``fallback``: ``"refuse"`` (default) or ``"disk"``. What happens when no daemon listens on
  ``socket``: refuse (the instance fails to start, saying so) or load from disk with a loud warning
  (vLLM's own loader; private weights, no sharing). Any other failure (a fingerprint mismatch, a
  model the daemon does not hold) always fails the start, with the reason.
- ``cpu_gemm``: ``"shared"`` (default) or ``"prepack"``, see failover_vllm.layout.cpu_gemm.
- ``report``: a file this loader writes (0600, JSON) once the weights are in place: ``source``
  (``cache`` or ``disk``), the fingerprint's key, and the bytes shared with the arena, copied and
  repacked. The supervisor reads it as the instance's ``weights_source``. With tensor parallelism
  each rank's worker runs this loader on its own rank's arena; rank 0 writes the report (its
  figures, ``tp_size`` beside them): the instance is ready only once every rank has loaded.

How: the model is built on the meta device (no weight memory), every parameter is registered as a
read-only view of the daemon's arena (cache_daemon.client.attach: one mmap of a memfd on CPU, one
VMM import on CUDA; no copy), buffers and tensor attributes get private copies
(failover_vllm.layout), then vLLM's ``process_weights_after_loading`` runs in "already processed"
mode so that only Python-side state (the GEMM dispatch, the attention backends' setup) is rebuilt.

Ownership: the arena is read-only in this process; a write through a parameter is a SIGSEGV (CPU)
or an illegal-address error (CUDA) in this instance alone. The mapping handle lives on the model
(``model.failover_weights``) for the life of the process; it is never closed while the model exists.
"""

from __future__ import annotations

import dataclasses
import time

import structlog
import torch

from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.model_executor.utils import weights_already_processed
from vllm.utils.torch_utils import set_default_torch_dtype

from cache_daemon import client
from cache_daemon.errors import CacheError, DaemonUnavailable, FingerprintMismatch

from . import layout
from .fingerprint import vllm_cache_config

log = structlog.get_logger(__name__)
LOAD_FORMAT = "failover"
FALLBACKS = ("refuse", "disk")


class FailoverWeightsError(RuntimeError):
    """The daemon's weights cannot be used; the message says why and what to do."""


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
    socket: str
    fallback: str = "refuse"
    cpu_gemm: str = "shared"
    report: str = ""

    @classmethod
    def parse(cls, extra: dict | None) -> Options:
        extra = dict(extra or {})
        if "socket" not in extra:
            raise ValueError("--load-format failover needs the daemon's socket: "
                             "--model-loader-extra-config '{\"socket\": \"/tmp/failover-UID/daemon.sock\"}'")
        unknown = sorted(set(extra) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"--load-format failover: unknown extra config key(s) {unknown}; "
                             "known: socket, fallback, cpu_gemm, report")
        opts = cls(**{k: str(v) for k, v in extra.items()})
        if opts.fallback not in FALLBACKS:
            raise ValueError(f"--load-format failover: fallback must be refuse or disk, not {opts.fallback!r}")
        if opts.cpu_gemm not in layout.CPU_GEMM_MODES:
            raise ValueError(f"--load-format failover: cpu_gemm must be shared or prepack, not {opts.cpu_gemm!r}")
        return opts


class FailoverModelLoader(BaseModelLoader):
    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.options = Options.parse(load_config.model_loader_extra_config)

    def download_model(self, model_config: ModelConfig) -> None:
        pass  # the daemon's loader child read the checkpoint

    def load_weights(self, model: torch.nn.Module, model_config: ModelConfig) -> None:
        raise FailoverWeightsError("weights mapped from failover's daemon are read-only and cannot be reloaded "
                                   "in place: restart the instance (the daemon reloads with `failover daemon`)")

    def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
        """Bytes held by the daemon, not this process (vLLM's CUDA memory budget leaves them out)."""
        try:
            return client.query(self.options.socket, self._config(vllm_config)).nbytes
        except CacheError:
            return 0  # load_model says why, with the remedy

    def _config(self, vllm_config: VllmConfig):
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        return vllm_cache_config(vllm_config, tp_rank=get_tensor_model_parallel_rank(),
                                 pp_rank=get_pp_group().rank_in_group)

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> torch.nn.Module:
        t0 = time.perf_counter()
        config = self._config(vllm_config)
        try:
            handle = client.attach(self.options.socket, config)
        except DaemonUnavailable as e:
            if self.options.fallback != "disk":
                raise FailoverWeightsError(f"{e}; or give this service weights = \"disk\" (or the loader "
                                           "fallback \"disk\") to read the checkpoint instead") from e
            log.warning("failover_weights_fallback_disk", socket=self.options.socket, reason=str(e),
                        consequence="loading from disk: private weights, slow start, no sharing")
            disk = dataclasses.replace(self.load_config, load_format="auto", model_loader_extra_config={})
            model = DefaultModelLoader(disk).load_model(vllm_config=vllm_config, model_config=model_config,
                                                        prefix=prefix)
            self._report(config, {"source": "disk", "reason": str(e)})
            return model
        except FingerprintMismatch as e:
            raise FailoverWeightsError("the cache daemon holds this model packed with other settings; differing "
                                       "fields (this instance != daemon): " + "; ".join(e.diff)
                                       + ". Restart the daemon with this instance's vLLM flags, or use "
                                       "weights = \"disk\"") from e
        except CacheError as e:
            raise FailoverWeightsError(f"the cache daemon at {self.options.socket} refused the weights: {e}") from e
        model = self._build(vllm_config, model_config, prefix, handle)
        seconds = round(time.perf_counter() - t0, 4)
        log.info("failover_weights_mapped", key=config.key, tp_rank=config.tp_rank, seconds=seconds,
                 cpu_gemm=self.options.cpu_gemm, **model.failover_figures)
        self._report(config, {"source": "cache", "key": config.key, "seconds": seconds,
                              "cpu_gemm": self.options.cpu_gemm, **model.failover_figures})
        return model

    def _report(self, config, info: dict) -> None:
        if not self.options.report or config.tp_rank != 0 or config.pp_rank != 0:
            return  # one report per instance (see the module docstring)
        info |= {"tp_size": config.tp_size}
        import json
        import os

        tmp = f"{self.options.report}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({**info, "pid": os.getpid()}, f)
        os.replace(tmp, self.options.report)

    def _build(self, vllm_config, model_config, prefix: str, handle) -> torch.nn.Module:
        target = torch.device(vllm_config.device_config.device if self.load_config.device is None
                              else self.load_config.device)
        kinds = {e.name: e.attrs.get("kind", layout.PARAM) for e in handle.manifest.tensors}
        with set_default_torch_dtype(model_config.dtype):
            with torch.device("meta"):
                model = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
            figures = layout.apply(model, kinds, handle.tensors, handle.manifest.aliases)
            # The arena holds post-processed tensors: vLLM only rebuilds its Python-side state here.
            mapped = layout.arena_params(model, handle.tensors.values())
            with weights_already_processed(), layout.cpu_gemm(self.options.cpu_gemm):
                process_weights_after_loading(model, model_config, target)
            still = layout.arena_params(model, handle.tensors.values())
            # parameters post-processing took off the arena (prepack: into the GEMM library's own copy)
            figures["repacked_tensors"] = len(mapped.keys() - still.keys())
            figures["repacked_bytes"] = sum(mapped[n] for n in mapped.keys() - still.keys())
            figures["shared_tensors"], figures["shared_bytes"] = len(still), sum(still.values())
        left = layout.meta_leftovers(model)
        if left:
            raise FailoverWeightsError(f"the daemon's arena has no tensor for {', '.join(left[:5])}"
                                       f"{' ...' if len(left) > 5 else ''}: it was packed by another vLLM "
                                       "build; restart the daemon")
        if target.type == "cpu":
            from engine.weights import prefault  # one madvise per range instead of a fault per page

            prefault(p for p in model.parameters() if p.numel())
        model.failover_weights = handle  # keeps the mapping for the life of the model
        model.failover_figures = figures
        return model.eval()

"""The rules of a service's engine: the engine kind's own keys, and a command engine's template.

Split out of ``failover.config.schema`` (which calls these from ``parse_config``); ``svc`` is a
``ServiceConfig``.
"""

from __future__ import annotations

import re

TEMPLATE_FIELDS = ("model", "host", "port", "name", "service", "socket", "tp", "dtype", "device",
                   "transform", "kv_memory", "run_dir")


def check_engine(key: str, svc) -> list[str]:
    problems = []
    if svc.cpu_threads is not None and (svc.engine != "failover" or svc.command is not None):
        problems.append(f"{key}.cpu_threads: sets the bundled engine's torch threads; this service runs "
                        f"{'its own command' if svc.command is not None else 'vLLM'} (give it its own "
                        "settings through engine_args / engine_env, or its command)")
    if svc.engine == "failover":
        unused = [k for k in ("engine_args", "engine_python", "engine_env") if getattr(svc, k)]
        problems += [f"{key}.{k}: only for engine = \"vllm\"; remove it (or set engine)" for k in unused]
        if svc.weights != "cache":
            problems.append(f"{key}.weights: the bundled engine always maps the cache daemon's weights; "
                            "weights = \"disk\" is only for engine = \"vllm\"")
        if svc.cpu_gemm != "shared":
            problems.append(f"{key}.cpu_gemm: only for engine = \"vllm\" with weights = \"cache\"; remove it")
        return problems
    if svc.cpu_gemm != "shared" and svc.weights != "cache":
        problems.append(f"{key}.cpu_gemm: {svc.cpu_gemm!r} chooses how vLLM runs on the cache daemon's weights; "
                        "with weights = \"disk\" vLLM packs its own copy anyway: remove it")
    if svc.command is not None:
        problems.append(f"{key}.command: engine = {svc.engine!r} builds its own command line; remove command "
                        "(extra flags go in engine_args)")
    owned = {"--model", "--port", "--host", "--served-model-name", "--kv-cache-memory-bytes"}
    if svc.weights == "cache":
        owned |= {"--load-format", "--model-loader-extra-config"}
    for arg in svc.engine_args:
        if arg.split("=", 1)[0] in owned:
            problems.append(f"{key}.engine_args: {arg!r} is set by the supervisor (from model.path, the "
                            "service's name, port, kv_memory and weights); remove it")
    return problems


def check_template(key: str, command: list[str]) -> list[str]:
    problems = []
    if not command:
        problems.append(f"{key}.command: empty; give an argv list such as [\"vllm\", \"serve\", \"{{model}}\", \"--port\", \"{{port}}\"]")
    for part in command:
        for field in re.findall(r"{([^{}]*)}", part):
            if field not in TEMPLATE_FIELDS:
                problems.append(f"{key}.command: unknown placeholder {{{field}}}; allowed: "
                                + ", ".join("{%s}" % f for f in TEMPLATE_FIELDS))
    return problems

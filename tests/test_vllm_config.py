"""The vLLM engine kind in the node config: what it accepts, what it refuses, the argv it builds."""

from __future__ import annotations

import pytest

from failover.config.schema import ConfigError, parse_config
from failover.node.engine_kinds import kind_of, needs_cache, vllm_argv, vllm_kv_bytes


def _raw(**service) -> dict:
    return {"run_dir": "/tmp/fo-x", "model": {"path": "/m", "device": "cpu", "dtype": "float32"},
            "service": [{"name": "chat", "port": 9100, **service}]}


def test_a_vllm_service_builds_vllms_command_line_with_its_args_last():
    config = parse_config(_raw(engine="vllm", engine_args=["--enforce-eager"], kv_memory="1GiB",
                               standby_kv_memory="256MiB", max_model_len=512, engine_python="/opt/v/bin/python"))
    svc = config.service[0]
    argv = vllm_argv(config, svc, 9101, vllm_kv_bytes(svc, primary=False))
    assert argv[:3] == ["/opt/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--port") + 1] == "9101" and argv[argv.index("--served-model-name") + 1] == "chat"
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(256 << 20)
    assert argv[-1] == "--enforce-eager" and argv[argv.index("--max-model-len") + 1] == "512"
    assert vllm_kv_bytes(svc, primary=True) == 1 << 30
    assert kind_of(svc).probe_path == "/health" and kind_of(svc).tree and not kind_of(svc).resizable_kv
    assert not needs_cache(config)


def test_a_vllm_standby_gets_the_full_pool_unless_told_otherwise():
    svc = parse_config(_raw(engine="vllm", kv_memory="1GiB")).service[0]
    assert vllm_kv_bytes(svc, primary=False) == 1 << 30  # vLLM cannot grow its pool at promotion


@pytest.mark.parametrize("service, words", [
    ({"engine": "vllm", "engine_args": ["--port=1"]}, "set by the supervisor"),
    ({"engine": "vllm", "command": ["vllm", "serve"]}, "builds its own command line"),
    ({"engine_args": ["--enforce-eager"]}, 'only for engine = "vllm"'),
    ({"engine": "sglang"}, "engine"),
])
def test_bad_engine_settings_are_refused_naming_the_key(service, words):
    with pytest.raises(ConfigError, match=words):
        parse_config(_raw(**service))

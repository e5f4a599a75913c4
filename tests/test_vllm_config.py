"""The vLLM engine kind in the node config: what it accepts, what it refuses, the argv it builds."""

from __future__ import annotations

import pytest

import json

from failover.config.argv import daemon_argv
from failover.config.schema import ConfigError, parse_config
from failover.node.engine_kinds import kind_of, needs_cache, needs_zygote, vllm_argv, vllm_kv_bytes


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
    assert needs_cache(config) and not needs_zygote(config)  # weights = "cache" is the default


def test_a_vllm_service_maps_the_daemons_weights_by_default_and_the_daemon_packs_vllms_layout():
    config = parse_config(_raw(engine="vllm", engine_args=["--enforce-eager"], max_model_len=512,
                               engine_python="/opt/v/bin/python"))
    argv = vllm_argv(config, config.service[0], 9100, 1 << 28, report="/tmp/fo-x/chat-0.weights.json")
    assert argv[argv.index("--load-format") + 1] == "failover"
    extra = json.loads(argv[argv.index("--model-loader-extra-config") + 1])
    assert extra == {"socket": str(config.daemon_socket), "cpu_gemm": "shared", "report": "/tmp/fo-x/chat-0.weights.json"}
    d = daemon_argv(config)
    assert d[d.index("--engine") + 1] == "vllm" and d[d.index("--engine-python") + 1] == "/opt/v/bin/python"
    assert "--engine-arg=--enforce-eager" in d and "--engine-arg=--max-model-len=512" in d


def test_cpu_gemm_prepack_reaches_the_model_loader_and_leaves_the_daemons_packing_alone():
    config = parse_config(_raw(engine="vllm", cpu_gemm="prepack"))
    argv = vllm_argv(config, config.service[0], 9100, 1 << 28)
    assert json.loads(argv[argv.index("--model-loader-extra-config") + 1])["cpu_gemm"] == "prepack"
    assert daemon_argv(config) == daemon_argv(parse_config(_raw(engine="vllm")))  # one arena for both modes


def test_weights_disk_opts_a_vllm_service_out_of_the_daemon():
    config = parse_config(_raw(engine="vllm", weights="disk", engine_args=["--load-format=safetensors"]))
    argv = vllm_argv(config, config.service[0], 9100, 1 << 28)
    assert "--model-loader-extra-config" not in argv and argv[-1] == "--load-format=safetensors"
    assert not needs_cache(config) and "--engine" not in daemon_argv(config)


def test_a_vllm_standby_gets_the_full_pool_unless_told_otherwise():
    svc = parse_config(_raw(engine="vllm", kv_memory="1GiB")).service[0]
    assert vllm_kv_bytes(svc, primary=False) == 1 << 30  # vLLM cannot grow its pool at promotion


@pytest.mark.parametrize("service, words", [
    ({"engine": "vllm", "engine_args": ["--port=1"]}, "set by the supervisor"),
    ({"engine": "vllm", "command": ["vllm", "serve"]}, "builds its own command line"),
    ({"engine_args": ["--enforce-eager"]}, 'only for engine = "vllm"'),
    ({"engine": "sglang"}, "engine"),
    ({"engine": "vllm", "weights": "ram"}, r"service\[0\]\.weights"),
    ({"weights": "disk"}, "bundled engine always maps"),
    ({"engine": "vllm", "engine_args": ["--load-format", "auto"]}, "set by the supervisor"),
    ({"engine": "vllm", "cpu_gemm": "onednn"}, r"service\[0\]\.cpu_gemm"),
    ({"engine": "vllm", "weights": "disk", "cpu_gemm": "prepack"}, "packs its own copy anyway"),
    ({"cpu_gemm": "prepack"}, 'only for engine = "vllm" with weights = "cache"'),
])
def test_bad_engine_settings_are_refused_naming_the_key(service, words):
    with pytest.raises(ConfigError, match=words):
        parse_config(_raw(**service))


def test_vllm_services_that_map_the_daemon_cannot_share_a_node_with_the_bundled_engine():
    raw = _raw(engine="vllm")
    raw["service"].append({"name": "ours", "port": 9200})
    with pytest.raises(ConfigError, match='two layouts.*weights = "disk"'):
        parse_config(raw)
    raw["service"][0]["weights"] = "disk"
    assert needs_cache(parse_config(raw))  # ours still maps it


def _vllm_node(tiny_model, run_dir, **service):
    from supervisor_helpers import write_config
    from failover.config.schema import load_config
    return load_config(write_config(run_dir / f"n{len(list(run_dir.iterdir()))}.toml", model=tiny_model,
                                    run_dir=run_dir / "run",
                                    service_extra={"engine": "vllm", "kv_memory": "256MiB", **service}))


def test_up_refuses_an_engine_python_without_vllm_or_without_failovers_plugin(tiny_model, run_dir, tmp_path,
                                                                              monkeypatch):
    """Real interpreters: a missing one; a bare venv; the same venv with a vllm package on its path
    but no failover installed; this test's own interpreter (vllm and the plugin where vLLM's venv runs it)."""
    import subprocess
    import sys

    from failover.config.preflight import preflight
    from vllm_helpers import HAVE_VLLM

    with pytest.raises(ConfigError, match=r"service\[0\] \(chat\).engine_python: /nonexistent/python cannot be run"):
        preflight(_vllm_node(tiny_model, run_dir, engine_python="/nonexistent/python"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    bare = str(tmp_path / "bare" / "bin" / "python")
    with pytest.raises(ConfigError, match=r"engine_python: .*/bare/bin/python cannot import vllm"):
        preflight(_vllm_node(tiny_model, run_dir, engine_python=bare))
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text("")
    with monkeypatch.context() as m:  # the engine's environment is ours plus engine_env
        m.setenv("PYTHONPATH", str(tmp_path / "site"))
        m.chdir(tmp_path)  # as vLLM, the probe imports from the working dir too: not this checkout's
        with pytest.raises(ConfigError, match=r"failover is not installed in .*/bare/bin/python's environment"):
            preflight(_vllm_node(tiny_model, run_dir, engine_python=bare))
    ours = _vllm_node(tiny_model, run_dir, engine_python=sys.executable)
    if HAVE_VLLM:  # vLLM's venv has failover installed (README): the check passes
        preflight(ours)
    else:
        with pytest.raises(ConfigError, match=r"cannot import vllm"):
            preflight(ours)

import json

import pytest
from safetensors import safe_open

from failover.cli import main as cli_main
from failover.tools.tiny_model import TinySpec, tensor_shapes


def test_tiny_model_writes_index_and_every_tensor(tmp_path, capsys):
    assert cli_main(["tiny-model", str(tmp_path), "--arch", "qwen2", "--shards", "3"]) == 0
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    expected = tensor_shapes(TinySpec(arch="qwen2"))
    assert set(index["weight_map"]) == set(expected)
    for name, fname in index["weight_map"].items():
        with safe_open(str(tmp_path / fname), "pt") as f:
            assert tuple(f.get_slice(name).get_shape()) == expected[name]
    assert "wrote qwen2 checkpoint" in capsys.readouterr().out


def test_tiny_model_rejects_bad_geometry(tmp_path, capsys):
    assert cli_main(["tiny-model", str(tmp_path), "--heads", "4", "--kv-heads", "3"]) == 2
    assert "multiple of kv_heads" in capsys.readouterr().err


def test_unknown_command_is_an_error(capsys):
    assert cli_main(["no-such-command"]) == 2
    assert "unknown command" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_transformers_loads_the_checkpoint(tmp_path, arch):
    transformers = pytest.importorskip("transformers")
    cli_main(["tiny-model", str(tmp_path), "--arch", arch])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids = tok("Hello, world!", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], 512)

import json
import os

import pytest

from failover.batch_io import BatchInputError, BatchOutputError, ResultLog, read_items


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_ids_given_derived_and_openai_batch_form(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [
        json.dumps({"id": "a", "prompt": "hi", "max_tokens": 3}),
        json.dumps({"prompt": "no id here"}),
        "",
        json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "x"}]}}),
    ])
    items = list(read_items(src))
    assert [i.id for i in items] == ["a", "in.jsonl:2", "c"]
    assert [i.url for i in items] == ["/v1/completions", "/v1/completions", "/v1/chat/completions"]
    assert all(not i.error for i in items)
    assert "id" not in items[0].body


def test_bad_lines_become_error_items_with_their_line(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [
        "{not json", "[1, 2]", json.dumps({"messages": "x", "stream": True}),
        json.dumps({"custom_id": "u", "url": "/v1/embeddings", "body": {}}),
        json.dumps({"id": "d", "prompt": "x"}), json.dumps({"id": "d", "prompt": "y"}),
        json.dumps({"custom_id": "m", "url": "/v1/completions", "body": {"max_tokens": 1}}),
    ])
    items = list(read_items(src))
    errors = {i.source: i.error for i in items if i.error}
    assert errors["in.jsonl:1"].startswith("line is not JSON")
    assert errors["in.jsonl:2"] == "line is not a JSON object"
    assert errors["in.jsonl:3"] == "batch requests cannot stream"
    assert "url must be one of" in errors["in.jsonl:4"]
    assert errors["in.jsonl:6"] == "duplicate id 'd'"
    assert errors["in.jsonl:7"] == "request has no 'prompt'"
    assert not [i for i in items if i.source == "in.jsonl:5"][0].error


def test_folder_input_in_name_order_and_missing_input(tmp_path):
    write_lines(tmp_path / "b.jsonl", [json.dumps({"id": "2", "prompt": "b"})])
    write_lines(tmp_path / "a.jsonl", [json.dumps({"id": "1", "prompt": "a"})])
    (tmp_path / "notes.txt").write_text("ignored")
    assert [i.id for i in read_items(tmp_path)] == ["1", "2"]
    with pytest.raises(BatchInputError, match="does not exist"):
        list(read_items(tmp_path / "nope.jsonl"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BatchInputError, match="no \\*.jsonl"):
        list(read_items(empty))


def test_result_log_survives_a_torn_line_and_refuses_duplicates(tmp_path):
    out = tmp_path / "out.jsonl"
    with ResultLog(out) as results:
        results.append({"id": "a", "v": 1})
        results.append({"id": "a", "v": 2})
    with out.open("a") as f:
        f.write('{"id": "b", "v"')  # a crash mid-append
    with ResultLog(out) as results:
        assert results.done == {"a"}
        results.append({"id": "b", "v": 3})
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == [{"id": "a", "v": 1}, {"id": "b", "v": 3}]


def test_unwritable_output_fails_before_any_work(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "out.jsonl").mkdir()  # a directory where the file should be: fails even as root
    with pytest.raises(BatchOutputError, match="cannot write batch output"):
        ResultLog(locked / "out.jsonl")
    assert os.listdir(locked / "out.jsonl") == []

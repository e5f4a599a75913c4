import json
import os

import pytest

from conftest import small_tmpfs
from failover.coserve.batch_io import BatchInputError, BatchOutputError, CorruptOutput, ResultLog, read_items


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


# --- outputs that another user may have planted or may read (issue 11, item 5) -------------------

NOBODY = 65534
FORGED = '{"id":"p1","response":{"status_code":200,"body":"forged"},"error":null}\n'


def test_a_precreated_world_writable_output_with_a_forged_line_is_refused_not_trusted(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(FORGED)
    os.chmod(out, 0o666)
    with pytest.raises(BatchOutputError, match=r"writable by group or others \(mode 0666\)"):
        ResultLog(out)
    os.chmod(out, 0o644)  # nobody else can write it, but everyone could read the results
    with pytest.raises(BatchOutputError, match=r"readable by more users than allowed \(mode 0644, allowed 0600\)"):
        ResultLog(out)
    with ResultLog(out, mode=0o644) as results:  # unless the config allows it (output_mode)
        assert results.done == {"p1"}
    assert out.read_text() == FORGED and oct(out.stat().st_mode & 0o777) == "0o644"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")
def test_an_output_of_another_uid_a_symlink_or_a_hard_link_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(FORGED)
    os.chmod(out, 0o600)
    os.chown(out, NOBODY, NOBODY)
    with pytest.raises(BatchOutputError, match=f"belongs to uid {NOBODY}, not to us"):
        ResultLog(out)
    secret = tmp_path / "secret"
    secret.write_text("root's\n")
    os.chmod(secret, 0o600)
    (tmp_path / "link.jsonl").symlink_to(secret)
    with pytest.raises(BatchOutputError, match="is a symbolic link"):
        ResultLog(tmp_path / "link.jsonl")
    os.link(secret, tmp_path / "hard.jsonl")
    with pytest.raises(BatchOutputError, match="has 2 hard links"):
        ResultLog(tmp_path / "hard.jsonl")
    assert secret.read_text() == "root's\n"


def test_a_new_output_is_created_0600_whatever_the_umask_or_as_configured(tmp_path):
    old = os.umask(0)
    try:
        with ResultLog(tmp_path / "a" / "out.jsonl") as results:
            results.append({"id": "x"})
        with ResultLog(tmp_path / "b.jsonl", mode=0o640):
            pass
    finally:
        os.umask(old)
    assert (tmp_path / "a" / "out.jsonl").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "b.jsonl").stat().st_mode & 0o777 == 0o640


# --- a full disk and a corrupt line (issue 11, item 7) -------------------------------------------

@pytest.fixture
def small_fs(tmp_path):
    """A 64 KiB tmpfs (a real full disk), unmounted afterwards."""
    with small_tmpfs(tmp_path / "small") as mnt:
        yield mnt


def test_a_full_disk_counts_only_whole_fsynced_lines_and_fails_with_the_file_and_free_space(small_fs):
    out = small_fs / "out.jsonl"
    results = ResultLog(out)
    pad = "x" * 3000  # lines that do not divide the room: the last write is short, then ENOSPC
    with pytest.raises(BatchOutputError) as failed:
        for i in range(100):
            results.append({"id": f"r{i}", "pad": pad})
    message = str(failed.value)
    assert f"cannot write batch output {out}: No space left on device" in message
    assert "bytes free there" in message and f"{len(results.done)} results are in it" in message
    data = out.read_bytes()
    assert data.endswith(b"\n"), "the torn line was cut back off"
    lines = [json.loads(line) for line in data.splitlines()]
    assert {r["id"] for r in lines} == results.done and 0 < len(lines) < 100
    with pytest.raises(BatchOutputError):  # a failed log stays failed: nothing more counts as done
        results.append({"id": "late"})
    results.close()
    with ResultLog(out) as again:
        assert again.done == {r["id"] for r in lines}


def test_a_corrupt_middle_line_is_refused_with_its_number_and_nothing_is_changed(tmp_path):
    out = tmp_path / "out.jsonl"
    text = '{"id":"a"}\n{"id":"b","resp\n{"id":"c"}\n{"id":"d",'  # line 2 corrupt, then a torn tail
    out.write_text(text)
    os.chmod(out, 0o600)
    with pytest.raises(CorruptOutput, match=f"line 2 of batch output {out} is not a result record") as e:
        ResultLog(out)
    assert e.value.lineno == 2 and out.read_text() == text
    out.write_text('{"id":"a"}\n{"no_id":1}\n')
    with pytest.raises(CorruptOutput, match=r"line 2 .* \(no 'id'\)"):
        ResultLog(out)

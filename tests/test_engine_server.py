"""A real ``failover engine`` process: the official openai SDK, the extensions, bad input, disconnects,
probes and metrics, graceful drain."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time

import pytest

from conftest import Procs, free_port
from engine_helpers import engine_log, get, metric, post, sse_events, start_engine, token_file, wait_engine_ready

openai = pytest.importorskip("openai")
MODEL = "tiny"
MAX_LEN = 128


@pytest.fixture(scope="module")
def server(tiny_model):
    procs, port = Procs(), free_port()
    start_engine(procs, tiny_model, port, "--weights", "disk", "--served-model-name", MODEL,
                 "--max-model-len", str(MAX_LEN), "--max-body-bytes", "64KiB")
    yield port
    procs.stop_all()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="unused", max_retries=0) as c:
        yield c


def completion(port, **body):
    status, text = post(port, "/v1/completions", {"model": MODEL, **body})
    assert status == 200, text
    return json.loads(text)


def test_sdk_completions(client):
    r = client.completions.create(model=MODEL, prompt="Hello, world!", max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=MODEL, prompt="Hello, world!", max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_sdk_chat(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "How are you today?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, seed=3)
    assert r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_sdk_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_token_ids_on_every_choice_and_prompt_as_ids(server):
    ids = [5, 17, 42, 99, 3]
    full = completion(server, prompt=ids, max_tokens=10, temperature=0, ignore_eos=True)
    token_ids = full["choices"][0]["token_ids"]
    assert len(token_ids) == 10 and full["usage"]["prompt_tokens"] == 5
    status, text = post(server, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 10,
                                                    "temperature": 0, "ignore_eos": True, "stream": True})
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    assert sum((e["choices"][0]["token_ids"] for e in events[:-1]), []) == token_ids
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == full["choices"][0]["text"]


@pytest.mark.parametrize("chat", [False, True])
def test_resume_token_ids_continue_a_seeded_stream(server, chat):
    base = {"model": MODEL, "max_tokens": 12, "temperature": 0.9, "seed": 77, "ignore_eos": True}
    if chat:
        base["messages"] = [{"role": "user", "content": "one two three"}]
    else:
        base["prompt"] = "one two three"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    _, text = post(server, path, base)
    full = json.loads(text)["choices"][0]
    for cut in (3, 7):
        _, text = post(server, path, {**base, "resume_token_ids": full["token_ids"][:cut]})
        body = json.loads(text)
        rest = body["choices"][0]
        assert full["token_ids"][:cut] + rest["token_ids"] == full["token_ids"]
        content = (lambda c: c["message"]["content"]) if chat else (lambda c: c["text"])
        assert content(full).endswith(content(rest))
        assert body["usage"]["completion_tokens"] == 12


def test_resume_that_already_used_max_tokens_finishes_at_once(server):
    body = completion(server, prompt="hi", max_tokens=3, resume_token_ids=[5, 6, 7])
    assert body["choices"][0]["token_ids"] == [] and body["choices"][0]["finish_reason"] == "length"


BAD = [
    ("malformed json", None, b"{not json", 400, "invalid_json"),
    ("not an object", [1, 2], None, 400, None),
    ("prompt wrong type", {"prompt": 5}, None, 400, None),
    ("max_tokens wrong type", {"prompt": "hi", "max_tokens": "10"}, None, 400, None),
    ("max_tokens bool", {"prompt": "hi", "max_tokens": True}, None, 400, None),
    ("negative max_tokens", {"prompt": "hi", "max_tokens": -1}, None, 400, None),
    ("huge max_tokens", {"prompt": "hi", "max_tokens": 10**9}, None, 400, "context_length_exceeded"),
    ("prompt too long", {"prompt": list(range(300)) * 1}, None, 400, None),
    ("prompt longer than context", {"prompt": [5] * MAX_LEN}, None, 400, "context_length_exceeded"),
    ("token id out of vocab", {"prompt": [5, 100000]}, None, 400, None),
    ("temperature out of range", {"prompt": "hi", "temperature": 7}, None, 400, None),
    ("top_p zero", {"prompt": "hi", "top_p": 0}, None, 400, None),
    ("stop wrong type", {"prompt": "hi", "stop": [1]}, None, 400, None),
    ("n > 1", {"prompt": "hi", "n": 2}, None, 400, None),
    ("stream wrong type", {"prompt": "hi", "stream": "yes"}, None, 400, None),
    ("resume wrong type", {"prompt": "hi", "resume_token_ids": "abc"}, None, 400, None),
    ("unknown model", {"model": "gpt-9", "prompt": "hi"}, None, 404, "model_not_found"),
    ("missing model", {"model": None, "prompt": "hi"}, None, 400, None),
    ("body over the cap", {"prompt": "x" * (80 << 10)}, None, 413, "body_too_large"),
]


@pytest.mark.parametrize("name,body,raw,status,code", BAD, ids=[b[0] for b in BAD])
def test_bad_completion_requests_get_openai_errors(server, name, body, raw, status, code):
    if isinstance(body, dict):
        body = {"model": MODEL, **body}
        body = {k: v for k, v in body.items() if v is not None}
    got, text = post(server, "/v1/completions", body, raw=raw)
    assert got == status, text
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code:
        assert err["code"] == code


@pytest.mark.parametrize("messages", [[], "hi", [{"role": "wizard", "content": "x"}],
                                      [{"role": "user", "content": 5}],
                                      [{"role": "user", "content": [{"type": "image_url"}]}]])
def test_bad_chat_messages(server, messages):
    got, text = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert got == 400 and json.loads(text)["error"]["param"].startswith("messages")


def test_unknown_route_and_method(server):
    assert get(server, "/v2/nothing")[0] == 404
    assert get(server, "/v1/completions")[0] == 405


def test_server_keeps_serving_after_bad_input(server):
    post(server, "/v1/completions", None, raw=b"\xff\xfe")
    assert completion(server, prompt="hi", max_tokens=2)["usage"]["completion_tokens"] == 2


def test_client_disconnect_mid_stream_stops_generation(server):
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=10)
    body = {"model": MODEL, "prompt": "one", "max_tokens": MAX_LEN - 10, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.fp.readline()  # first event arrived: the sequence is running
    resp.close()
    conn.close()
    deadline = time.monotonic() + 10
    while metric(server, "failover_engine_num_requests_running") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "failover_engine_num_requests_running") == 0
    generated = metric(server, "failover_engine_generation_tokens_total")
    time.sleep(0.3)
    assert metric(server, "failover_engine_generation_tokens_total") == generated  # nothing runs for it
    assert completion(server, prompt="hi", max_tokens=2)["usage"]["completion_tokens"] == 2


def test_probes_and_metrics(server):
    assert get(server, "/health") == (200, {"status": "ok", "state": "ready"})
    status, ready = get(server, "/ready")
    assert status == 200 and ready["ready"] is True and ready["weights_source"] == "disk"
    assert ready["max_model_len"] == MAX_LEN
    _, text = get(server, "/metrics")
    for name in ("requests_total", "generation_tokens_total", "time_to_first_token_seconds",
                 "inter_token_latency_seconds", "num_requests_running", "num_requests_waiting",
                 "kv_cache_usage_perc", "kv_cache_bytes", "kv_cache_blocks", "kv_cache_blocks_used",
                 "num_preemptions_total"):
        assert "\nfailover_engine_" + name in text


def test_admin_kv_is_refused_when_no_token_is_configured(server):
    before = get(server, "/ready")[1]["kv_bytes"]
    for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": "Bearer anything"}):
        status, text = post(server, "/admin/kv", {"kv_memory": 1 << 20}, headers=headers)
        assert status == 403 and json.loads(text)["error"]["code"] == "admin_disabled", text
    assert get(server, "/ready")[1]["kv_bytes"] == before  # never grown


def test_admin_kv_needs_the_bearer_token_from_the_token_file(tiny_model, procs):
    port = free_port()
    path, auth = token_file(procs)
    start_engine(procs, tiny_model, port, "--weights", "disk", "--kv-memory", "256KiB",
                 "--admin-token-file", str(path))
    body = {"kv_memory": 1 << 20}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": auth["Authorization"] + "x"},
                    {"Authorization": "Basic " + auth["Authorization"][7:]}):
        status, text = post(port, "/admin/kv", body, headers=headers)
        assert status == 401 and json.loads(text)["error"]["code"] == "unauthorized", (headers, text)
    assert get(port, "/ready")[1]["kv_blocks_total"] == 32  # 256 KiB of 8 KiB blocks
    status, text = post(port, "/admin/kv", body, headers=auth)
    assert status == 200 and json.loads(text)["kv_blocks_total"] == 128
    assert get(port, "/ready")[1]["kv_blocks_total"] == 128


def test_admin_kv_grows_and_shrinks_the_pool_and_the_metrics_show_it(tiny_model, procs):
    server = free_port()
    path, auth = token_file(procs)
    start_engine(procs, tiny_model, server, "--weights", "disk", "--served-model-name", MODEL,
                 "--max-model-len", str(MAX_LEN), "--admin-token-file", str(path))
    block = 8 << 10  # 2 (k, v) * 2 layers * 2 kv heads * 16 positions * 16 dims * 4 bytes
    full = 16 * (MAX_LEN // 16) * block  # --max-batch 16 contexts of MAX_LEN: the default pool's cap
    ready = get(server, "/ready")[1]
    assert (ready["kv_bytes"], ready["kv_blocks_total"], ready["kv_block_size"]) == (full, full // block, 16)

    def resize(nbytes: int) -> dict:
        status, text = post(server, "/admin/kv", {"kv_memory": nbytes}, headers=auth)
        assert status == 200, text
        return json.loads(text)

    try:
        small = resize(20 * block + 5)
        assert (small["kv_bytes"], small["kv_blocks_total"], small["kv_blocks_used"]) == (20 * block, 20, 0)
        assert metric(server, "failover_engine_kv_cache_bytes") == 20 * block
        assert (metric(server, "failover_engine_kv_cache_blocks"), metric(server, "failover_engine_kv_cache_usage_perc")) == (20, 0)
        assert get(server, "/ready")[1]["kv_blocks_total"] == 20
        assert completion(server, prompt="hi", max_tokens=4)["usage"]["completion_tokens"] == 4
        assert resize(1)["kv_blocks_total"] == MAX_LEN // 16  # never below one full context
        grown = resize(1 << 40)  # never past what --max-batch sequences can use
        assert grown["kv_bytes"] == full and metric(server, "failover_engine_kv_cache_bytes") == full
        assert metric(server, "failover_engine_kv_cache_blocks_used") == 0
    finally:
        resize(full)


def test_sigterm_drains_in_flight_then_exits(tiny_model, procs):
    port = free_port()
    proc = start_engine(procs, tiny_model, port, "--weights", "disk", "--served-model-name", MODEL,
                        "--drain-timeout", "20")
    result = {}

    def long_request():
        result["resp"] = post(port, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 200,
                                                        "ignore_eos": True})

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 10
    while metric(port, "failover_engine_num_requests_running") == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while get(port, "/ready")[0] == 200 and time.monotonic() < deadline:
        time.sleep(0.02)
    status, body = get(port, "/ready")
    assert status == 503 and body["state"] == "draining"
    refused, text = post(port, "/v1/completions", {"model": MODEL, "prompt": "b"})
    assert refused == 503 and json.loads(text)["error"]["code"] == "not_ready"
    t.join(30)
    status, text = result["resp"]
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 200
    assert proc.wait(20) == 0


def test_bad_usage_and_bind_failure_exit_codes(tiny_model, procs, server):
    bad = start_engine(procs, tiny_model, 1, "--tp", "3", wait=False)
    assert bad.wait(30) == 2 and "--tp 3 must divide" in engine_log(bad)
    taken = start_engine(procs, tiny_model, server, "--weights", "disk", wait=False)
    assert taken.wait(30) == 1 and "cannot listen" in engine_log(taken)
    path, _ = token_file(procs)
    path.chmod(0o644)
    loose = start_engine(procs, tiny_model, free_port(), "--admin-token-file", str(path), wait=False)
    assert loose.wait(30) == 2 and f"chmod 600 {path}" in engine_log(loose)
    wide = start_engine(procs, tiny_model, free_port(), "--max-batch", "4", "--warmup-batch", "5", wait=False)
    assert wide.wait(30) == 2 and "--warmup-batch must be in 1..--max-batch" in engine_log(wide)


def test_a_full_batch_warm_up_leaves_the_pool_empty_and_the_engine_serving(tiny_model, procs):
    """--warmup-batch N runs N sequences to the end before /ready (the default on CUDA): nothing of
    it stays in the pool, in the preemption count or in the outputs of the first real request."""
    port = free_port()
    proc = start_engine(procs, tiny_model, port, "--weights", "disk", "--served-model-name", MODEL,
                        "--kv-memory", "1MiB", "--max-batch", "8", "--warmup-batch", "8")
    ready = get(port, "/ready")[1]
    assert (ready["kv_blocks_used"], ready["kv_preemptions"]) == (0, 0)
    body = {"model": MODEL, "prompt": [5, 17, 42], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    status, text = post(port, "/v1/completions", body)
    assert status == 200, text
    warm = json.loads(text)["choices"][0]["token_ids"]
    cold_port = free_port()
    start_engine(procs, tiny_model, cold_port, "--weights", "disk", "--served-model-name", MODEL,
                 "--kv-memory", "1MiB", "--max-batch", "8", "--warmup-batch", "1")
    assert json.loads(post(cold_port, "/v1/completions", body)[1])["choices"][0]["token_ids"] == warm
    assert proc.poll() is None



FORK_SCRIPT = """
import os, signal, sys, threading
import torch, engine.cli
assert threading.active_count() == 1, threading.enumerate()
assert not torch.cuda.is_initialized()
pid = os.fork()
if pid == 0:
    os._exit(engine.cli.main(sys.argv[1:]))
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM is for the engine; report its code
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_main_runs_in_a_forked_child_of_a_process_that_imported_engine(tiny_model, procs):
    port = free_port()
    path, auth = token_file(procs)
    proc = procs.python("-c", FORK_SCRIPT, "--model", str(tiny_model), "--port", str(port), "--weights", "disk",
                        "--served-model-name", MODEL, "--kv-memory", "256KiB", "--admin-token-file", str(path))
    assert wait_engine_ready(proc, port)["kv_blocks_total"] == 32  # 256 KiB of 8 KiB blocks
    status, text = post(port, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert status == 200, text
    # a standby's pool grows into memory that was freed (POST /admin/kv)
    assert post(port, "/admin/kv", {"kv_memory": "1M"}, headers=auth)[0] == 400
    status, text = post(port, "/admin/kv", {"kv_memory": 1 << 20}, headers=auth)
    assert status == 200 and json.loads(text)["kv_blocks_total"] == 128
    assert get(port, "/ready")[1]["kv_bytes"] == 1 << 20
    procs.stop_all()
    assert proc.returncode == 0


@pytest.mark.parametrize("usage", [False, True])
def test_a_streams_end_goes_out_in_one_write(server, usage):
    """The finishing event, the usage event, [DONE] and the chunked terminator leave in one write, so
    a proxy (ours or HAProxy) reads a stream's end in one wake-up; the bytes are those of separate
    writes, events in order."""
    import socket

    body = json.dumps({"model": MODEL, "prompt": "one two three", "max_tokens": 6, "temperature": 0,
                       "stream": True, **({"stream_options": {"include_usage": True}} if usage else {})}).encode()
    with socket.create_connection(("127.0.0.1", server), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        reads = []
        while not b"".join(reads).endswith(b"\r\n0\r\n\r\n"):
            data = s.recv(65536)
            assert data, b"".join(reads)
            reads.append(data)
    last = reads[-1]
    assert b'"finish_reason":"length"' in last and last.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), reads
    assert (b'"usage":{' in last) is usage
    stream = b"".join(reads)
    events = [e for e in stream.split(b"\n\n") if b"data: " in e]
    assert len(events) >= 3 and b"[DONE]" in events[-1]
    assert stream.count(b'"finish_reason":"length"') == 1

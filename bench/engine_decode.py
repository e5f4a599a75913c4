"""The decode and first-token half of ``bench/engine.py``: the engine in process (CUDA graphs captured
first, their capture timed) against transformers' ``generate`` on the same checkpoint, beside the
roofline of each batch (bytes a step must read / the device's measured copy bandwidth).

Decode tokens/s = ``B * (T - 1) / time from the first generated token to the last`` (median of 3),
so prefill is excluded; transformers' first token is timed through ``generate``'s streamer hook.
Time to first token = one ``add`` + the step that prefills and samples (the engine's own path,
no HTTP), with the device synchronized.
"""

from __future__ import annotations

import time


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def copy_bandwidth(device: str) -> float | None:
    """Bytes/s of a large device-to-device copy, counting bytes read plus bytes written."""
    import torch

    if device != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, n = time.perf_counter(), 20
    for _ in range(n):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * n / (time.perf_counter() - start)


def bench_decode(model, args) -> dict:
    import torch

    try:
        import transformers
    except ImportError:
        transformers = None
        print("transformers is not installed: decode figures for the engine only")

    from dataclasses import replace

    from cache_daemon.checkpoint import load_shards
    from engine.config import EngineConfig, ModelConfig
    from engine.llm_engine import LLMEngine
    from engine.model_runner import ModelRunner
    from engine.sampling import SamplingParams
    from engine.scheduler import Sequence
    from engine.tokenizer import Tokenizer

    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    ttft_len = args.ttft_prompt_len
    max_len = max(args.prompt_len + args.new_tokens, ttft_len + 2) + 8
    cfg = EngineConfig(model=model, weights="disk", device=args.device, dtype=args.dtype,
                       max_batch=max(max(batches), args.ttft_batch), kv_memory=args.kv_gib << 30,
                       max_model_len=max_len, cuda_graphs=not args.no_graphs)
    weights = load_shards(model, dtype=dtype)
    if args.device == "cuda" and args.separate_projections:
        weights = {k: v.cuda() for k, v in weights.items()}
    elif args.device == "cuda":  # as the engine's --weights disk (and a mapped engine's arena) lay them out
        from engine.fusion import pack_onto

        weights = pack_onto(weights, torch.device("cuda"))
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    # a step reads every weight but the embedding table (one row per token), unless it is tied to lm_head
    read_bytes = weight_bytes - (0 if "lm_head.weight" not in weights else
                                 weights["model.embed_tokens.weight"].numel() * dtype.itemsize)
    mcfg = ModelConfig.from_dir(model)
    runner = ModelRunner(replace(cfg), mcfg, weights)
    engine = LLMEngine(runner, Tokenizer(model), ())
    engine.warmup()
    start = time.perf_counter()
    while engine.capture_graph():
        pass
    graphs_s = time.perf_counter() - start
    gen = torch.Generator().manual_seed(0)

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    def prompts(b, n=args.prompt_len):
        return torch.randint(3, 500, (b, n), generator=gen).tolist()

    def seqs_for(b, new, n=args.prompt_len):
        return [Sequence(f"{b}-{new}-{i}-{time.monotonic_ns()}", p,
                         SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True), 0)
                for i, p in enumerate(prompts(b, n))]

    def ours(b, new) -> float:
        seqs = seqs_for(b, new)
        for s in seqs:
            engine.add(s)
        engine.step()  # admits and prefills all of them (one forward), first token each
        sync()
        t0 = time.perf_counter()
        while engine.has_work():
            engine.step()
        sync()
        assert all(len(s.output_ids) == new for s in seqs)
        return time.perf_counter() - t0

    def ttft(b) -> float:
        seqs = seqs_for(b, 2, ttft_len)
        sync()
        t0 = time.perf_counter()
        for s in seqs:
            engine.add(s)
        engine.step()
        sync()
        took = time.perf_counter() - t0
        assert all(len(s.output_ids) == 1 for s in seqs)
        while engine.has_work():
            engine.step()
        return took

    results: dict = {"graphs_s": graphs_s, "graph_buckets": runner.graphs_captured, "weight_bytes": weight_bytes,
                     "read_bytes": read_bytes, "fused": runner.model.model.layers[0].mlp.gate_up is not None,
                     "ttft": {}}
    for b in (1, args.ttft_batch):
        ttft(b)  # warm this shape
        results["ttft"][b] = median([ttft(b) for _ in range(3)])
    hf = None
    if transformers is not None and not args.skip_transformers:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype).to(args.device).eval()

    class FirstToken:
        """generate() calls put() with the prompt, then with each new token: time the first new one."""

        def __init__(self) -> None:
            self.calls, self.at = 0, None

        def put(self, value) -> None:
            self.calls += 1
            if self.calls == 2:
                sync()
                self.at = time.perf_counter()

        def end(self) -> None:
            pass

    def theirs(b, new) -> float:
        ids = torch.tensor(prompts(b), device=args.device)
        first = FirstToken()
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=0, streamer=first)
        sync()
        assert out.shape[1] == args.prompt_len + new
        return time.perf_counter() - first.at

    bandwidth = copy_bandwidth(args.device)
    results["bandwidth"] = bandwidth
    kv_per_token = 2 * mcfg.num_layers * mcfg.num_kv_heads * mcfg.head_dim * dtype.itemsize
    rows = {}
    for b in batches:
        row = {}
        for name, fn in (("engine", ours), ("transformers", theirs))[:2 if hf is not None else 1]:
            fn(b, 3)  # warm this batch size
            row[name] = b * (args.new_tokens - 1) / median([fn(b, args.new_tokens) for _ in range(3)])
        graph = runner.decoder.graphs.get(b) if runner.decoder is not None else None
        if graph is not None:
            # the device's share of a step: replay the last step of that run (its rows and contexts
            # are still in the static buffers; it rewrites the same K/V into blocks now free)
            sync()
            t0 = time.perf_counter()
            for _ in range(20):
                graph[0].replay()
            sync()
            row["replay_ms"] = (time.perf_counter() - t0) / 20 * 1e3
        if bandwidth:
            # every step reads every weight once and each row's KV so far (mean context over the run)
            ctx = args.prompt_len + args.new_tokens / 2
            row["roofline"] = b / ((read_bytes + b * ctx * kv_per_token) / bandwidth)
        rows[b] = row
    results["decode"] = rows
    return results


def print_decode(results: dict, args) -> None:
    bw = results["bandwidth"]
    print(f"\nCUDA graphs: {results['graph_buckets']} buckets captured in {results['graphs_s']:.2f} s (after warm-up, "
          f"before timing)" if results["graph_buckets"] else "\nCUDA graphs: none (eager decode)")
    if bw:
        print(f"copy bandwidth (device to device, read + write): {bw / 1e12:.2f} TB/s; weights "
              f"{results['weight_bytes'] / (1 << 30):.2f} GiB, of which a step reads "
              f"{results['read_bytes'] / (1 << 30):.2f} GiB (all but the embedding table) + each row's KV")
    projections = "fused q/k/v and gate/up GEMMs" if results["fused"] else "one GEMM per projection"
    print(f"decode tokens/s (prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy, prefill excluded, "
          f"median of 3; {projections})")
    for b, row in results["decode"].items():
        line = f"  batch {b:>3}: engine {row['engine']:9.1f}"
        if "transformers" in row:
            line += f"   transformers {row['transformers']:9.1f}   ratio {row['engine'] / row['transformers']:5.2f}x"
        if "replay_ms" in row:
            line += f"   (graph replay alone {row['replay_ms']:.2f} ms = {b / row['replay_ms'] * 1e3:8.1f} tok/s)"
        if "roofline" in row:
            line += f"   roofline {row['roofline']:9.1f}   engine/roofline {row['engine'] / row['roofline']:.2f}"
        print(line)
    print(f"time to first token, {args.ttft_prompt_len}-token prompt (add -> first token sampled, in process, "
          f"median of 3):")
    for b, s in results["ttft"].items():
        print(f"  {b} prompt{'s' if b > 1 else ''} together: {s * 1e3:8.1f} ms")

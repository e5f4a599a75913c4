"""How much slower a fresh engine's first full batch is than its next ones (CUDA).

    python3 bench/first_wave.py                                # 16 layers, hidden 4096, bf16, batch 16
    python3 bench/first_wave.py --cudnn-attention              # the same with cuDNN attention allowed
    python3 bench/first_wave.py --warmup-batch 16              # with a full-batch warm-up wave first

Builds the engine in this process on a random-weight checkpoint, warms it up as ``failover engine``
does, then runs three waves of 16 greedy sequences (prompts of 30-45 tokens, 32 new tokens) and
prints each wave's step times: a promoted standby's first requests after a failover are its first
wave. Figures: README's benchmark table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--warmup-batch", type=int, default=1)
    p.add_argument("--cudnn-attention", action="store_true")
    a = p.parse_args()
    import torch

    from cache_daemon.checkpoint import load_shards
    from engine.config import EngineConfig, ModelConfig
    from engine.llm_engine import LLMEngine
    from engine.model_runner import ModelRunner
    from engine.sampling import SamplingParams
    from engine.sequence import Sequence
    from engine.tokenizer import Tokenizer
    from failover.tools.tiny_model import TinySpec, write_checkpoint

    with tempfile.TemporaryDirectory(prefix="fo-first-wave-") as tmp:
        spec = TinySpec(arch="llama", hidden=a.hidden, heads=a.hidden // 128, kv_heads=max(a.hidden // 512, 1),
                        intermediate=a.hidden * 3, vocab=32000, layers=a.layers, max_positions=8192,
                        dtype="bfloat16", shards=2)
        model = write_checkpoint(Path(tmp) / "m", spec)
        cfg = EngineConfig(model=model, weights="disk", device="cuda", dtype="bfloat16", max_batch=a.batch,
                           kv_memory=4 << 30, warmup_batch=a.warmup_batch, cudnn_attention=a.cudnn_attention)
        weights = {k: v.cuda() for k, v in load_shards(model, dtype=torch.bfloat16).items()}
        t0 = time.perf_counter()
        engine = LLMEngine(ModelRunner(cfg, ModelConfig.from_dir(model), weights), Tokenizer(model), ())
        engine.warmup(cfg.warmup_batch)
        torch.cuda.synchronize()
        print(f"# bench/first_wave.py: {a.layers} layers, hidden {a.hidden}, bf16, {torch.cuda.get_device_name()}, "
              f"batch {a.batch}, cudnn_attention={a.cudnn_attention}, warmup_batch={a.warmup_batch}")
        print(f"build_and_warmup_s={time.perf_counter() - t0:.3f}")
        gen = torch.Generator().manual_seed(0)
        for wave in range(3):
            seqs = [Sequence(f"{wave}-{i}", torch.randint(3, 500, (30 + i,), generator=gen).tolist(),
                             SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), 0) for i in range(a.batch)]
            for seq in seqs:
                engine.add(seq)
            steps = []
            while engine.has_work():
                t = time.perf_counter()
                engine.step()
                torch.cuda.synchronize()
                steps.append((time.perf_counter() - t) * 1e3)
            print(f"wave_{wave}_total_ms={sum(steps):.0f} median_step_ms={sorted(steps)[len(steps) // 2]:.1f} "
                  f"first_steps_ms={','.join(f'{x:.0f}' for x in steps[:5])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training of a DeepSeek-V3-shaped model in transformers with the ``mla_cupy`` attention backend
against ``sdpa``: the loss curves, tokens per second and peak memory of each.

    python benchmarks/train_e2e.py --json train.json --plot train.png   # 4096 tokens, 200 steps each

The model has DeepSeek V3's attention (H = 128, qk_nope 128, qk_rope 64, v_head 128, kv_lora_rank
512, q_lora_rank 1536) in a few dense decoder layers of a small hidden size and vocabulary, random
initial weights in bfloat16, trained with AdamW. The data is a copy task that attention must solve:
each sequence is a random first half and its copy, so the loss falls only as the model learns to
look back. Both backends start from the same weights (one seed) and see the same sequences (one
seed per step); their losses stay within bf16 noise of each other, and the table says by how much
(the largest difference of 10-step means). Steps are timed by the wall clock between device
synchronizations after ``--warmup`` steps; the peak is ``torch.cuda.max_memory_allocated`` over the
training of each backend.

``--device cpu`` with small sizes runs the same steps without a GPU (the backend then runs the float64
reference): a check of this script, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

IMPLS = ("mla_cupy", "sdpa")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="sequence length (default 4096)")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per backend (default 200)")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the timing (default 5)")
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma-separated backends (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_path", default=None, help="write the results here")
    ap.add_argument("--plot", default=None, help="draw the loss curves into this PNG")
    args = ap.parse_args(argv)
    args.impls = [i for i in args.impls.split(",") if i]
    if not args.impls or any(i not in IMPLS for i in args.impls):
        ap.error(f"--impls: names of {', '.join(IMPLS)}, got {args.impls}")
    for name in ("tokens", "steps", "layers", "hidden", "heads", "intermediate", "vocab"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: expected a positive int")
    if args.tokens % 2:
        ap.error("--tokens: an even length (a half and its copy)")
    return args


def build_model(args, torch):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                           num_hidden_layers=args.layers, first_k_dense_replace=args.layers,
                           num_attention_heads=args.heads, num_key_value_heads=args.heads,
                           max_position_embeddings=args.tokens, n_routed_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=64, n_group=1, topk_group=1, q_lora_rank=1536, kv_lora_rank=512,
                           qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, attention_dropout=0.0)
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if args.device != "cpu" else torch.float32
    return DeepseekV3ForCausalLM(cfg).to(device=args.device, dtype=dtype).train()


def batch(args, step: int, torch):
    """Sequence ``step``: a random first half and its copy (tokens 1..vocab-1)."""
    g = torch.Generator().manual_seed(args.seed * 100003 + step)
    half = torch.randint(1, args.vocab, (1, args.tokens // 2), generator=g)
    return torch.cat([half, half], 1).to(args.device)


def train(args, impl: str, torch) -> Dict[str, object]:
    from mla_cupy.integrations import transformers as mt

    mt.register()
    model = build_model(args, torch)
    model.set_attn_implementation(impl)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    cuda = args.device != "cpu"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses: List[float] = []
    times: List[float] = []
    for step in range(args.steps):
        ids = batch(args, step, torch)
        t0 = time.perf_counter()
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    timed = times[args.warmup:] or times
    med = statistics.median(timed)
    return {"impl": impl, "losses": losses, "step_s_median": med, "tokens_per_s": args.tokens / med,
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None}


def window_means(xs: List[float], n: int = 10) -> List[float]:
    return [statistics.fmean(xs[i:i + n]) for i in range(0, len(xs), n)]


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from mla_cupy.bench import device_info

    runs = [train(args, impl, torch) for impl in args.impls]
    info = device_info() if args.device != "cpu" else {"device": "cpu"}
    try:
        from ab import checkout_commit  # benchmarks/ on the path (benchmarks/gpu.sh puts it there)

        info["commit"] = checkout_commit()
    except ImportError:
        pass
    base = runs[0]
    print(f"{args.layers} layers, hidden {args.hidden}, H = {args.heads}, {args.tokens} tokens, {args.steps} steps; "
          f"{info.get('device')}")
    print("| backend | first loss | last 10-step mean | tokens/s | ms per step | peak MiB | largest 10-step mean "
          f"difference from {base['impl']} |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        diff = max(abs(a - b) for a, b in zip(window_means(r["losses"]), window_means(base["losses"])))
        r["max_window_diff"] = diff
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        print(f"| {r['impl']} | {r['losses'][0]:.3f} | {window_means(r['losses'])[-1]:.3f} | {r['tokens_per_s']:.0f} | "
              f"{1e3 * r['step_s_median']:.1f} | {peak} | {diff:.3f} |")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({**info, "args": vars(args), "runs": runs}, f, indent=1)
        print(f"wrote {args.json_path}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for r in runs:
            ax.plot(r["losses"], label=f"{r['impl']} ({r['tokens_per_s']:.0f} tokens/s)", lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(f"copy task, {args.tokens} tokens, H = {args.heads}; {info.get('device')}, "
                     f"{info.get('date', '')} {info.get('commit', '')}".strip(), fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training of a DeepSeek-V3-shaped model in transformers with the ``mla_cupy`` attention backend
against ``sdpa``: the loss curves, tokens per second and peak memory of each.

    python benchmarks/train_e2e.py --json train.json --plot train.png   # 4096 tokens, 200 steps each

The model has DeepSeek V3's attention (H = 128, qk_nope 128, qk_rope 64, v_head 128, kv_lora_rank
512, q_lora_rank 1536) in a few dense decoder layers of a small hidden size and vocabulary, random
initial weights in bfloat16, trained with AdamW (beta2 0.95, as DeepSeek V3 was) after a linear
learning-rate warm-up of ``--lr-warmup`` steps. The data is a task that only attention can solve:
each sequence is cut into segments of ``--segment`` tokens, each a random pattern of ``--period``
tokens repeated to fill it, a new pattern per segment. From a segment's second period on, every
next token is the one ``period`` places back, a fixed relative offset that rope's relative
positions let the model learn. The loss is taken over those predictable tokens only (no model can
predict a segment's first period): it starts at about ln(vocab - 1) and falls towards 0 once the
model has learned to look back. The patterns' tokens are successive random permutations of
1..vocab-1, so that every token is about equally frequent in each sequence: a sequence's own token
counts are otherwise a signal the model chases from step to step instead of learning to look back
(one pattern for a whole sequence, or half a sequence and its copy, stayed at chance in our small
runs; with the unmasked loss it fell later). The defaults (period 8, segments of 32, lr 3e-4,
beta2 0.95, 10 warm-up steps) were picked on CPU runs of smaller models, up to hidden 1024 with
fewer heads and shorter sequences, where wider models needed the smaller learning rate: the
default sizes were not run to choose them.

Both backends start from the same weights (one seed) and see the same sequences (one seed per
step); their losses stay within bf16 noise of each other, and the table says by how much (the
largest difference of 10-step means; around the step where the loss starts to fall, a few steps'
shift between the two curves shows up there too). Steps are timed by the wall clock between device
synchronizations after ``--warmup`` steps; the peak is ``torch.cuda.max_memory_allocated`` over the
training of each backend.

``--impls mla_cupy,sdpa,eager`` adds transformers' eager attention (bf16 matmuls, a float32 softmax
of the whole score matrix): a control for how far the step where the loss falls moves between two
attentions that differ by rounding alone.

``--device cpu`` with small sizes runs the same steps without a GPU (the backend then runs the float64
reference): a check of this script, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

IMPLS = ("mla_cupy", "sdpa", "eager")  # eager: transformers' own attention (float32 softmax), a third rounding
DEFAULT_IMPLS = IMPLS[:2]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="sequence length (default 4096)")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per backend (default 200)")
    ap.add_argument("--warmup", type=int, default=5,
                    help="steps left out of the timing (default 5; the learning-rate warm-up is --lr-warmup)")
    ap.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                    help=f"comma-separated backends of {', '.join(IMPLS)} (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-4, help="AdamW's learning rate after the warm-up (default 3e-4)")
    ap.add_argument("--beta2", type=float, default=0.95, help="AdamW's beta2 (default 0.95, DeepSeek V3's)")
    ap.add_argument("--lr-warmup", type=int, default=10,
                    help="steps N of linear learning-rate warm-up, lr/N, 2 lr/N, ... lr (default 10; 0: none)")
    ap.add_argument("--period", type=int, default=8, help="tokens of each repeated random pattern (default 8)")
    ap.add_argument("--segment", type=int, default=32,
                    help="tokens of each segment, a new pattern per segment (default 32)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_path", default=None, help="write the results here")
    ap.add_argument("--plot", default=None, help="draw the loss curves into this PNG")
    args = ap.parse_args(argv)
    args.impls = [i for i in args.impls.split(",") if i]
    if not args.impls or any(i not in IMPLS for i in args.impls):
        ap.error(f"--impls: names of {', '.join(IMPLS)}, got {args.impls}")
    for name in ("tokens", "steps", "layers", "hidden", "heads", "intermediate", "vocab", "period", "segment"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: expected a positive int")
    if not 0.0 <= args.beta2 < 1.0:
        ap.error("--beta2: expected a value in [0, 1)")
    if args.lr_warmup < 0:
        ap.error("--lr-warmup: expected a non-negative int")
    if args.vocab < 2:
        ap.error("--vocab: at least 2 (the patterns draw tokens 1..vocab-1)")
    if not args.period < args.segment <= args.tokens:
        ap.error(f"--period {args.period}, --segment {args.segment}, --tokens {args.tokens}: expected "
                 "period < segment <= tokens (a pattern repeats within its segment)")
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
    """Sequence ``step``, ``[1, tokens]``: segments of ``segment`` tokens, each a random pattern of
    ``period`` tokens repeated (the last segment may be cut short). The patterns' tokens are
    successive random permutations of 1..vocab-1, so every token is about equally frequent."""
    g = torch.Generator().manual_seed(args.seed * 100003 + step)
    n = -(-args.tokens // args.segment)
    need = n * args.period
    draws = torch.cat([torch.randperm(args.vocab - 1, generator=g) + 1 for _ in range(-(-need // (args.vocab - 1)))])
    patterns = draws[:need].view(n, args.period)
    seq = patterns.repeat(1, -(-args.segment // args.period))[:, :args.segment].reshape(1, -1)
    return seq[:, :args.tokens].to(args.device)


def targets(args, ids, torch):
    """The labels of ``ids``: the tokens themselves, -100 (no loss) on each segment's first period,
    which no model can predict."""
    labels = ids.clone()
    labels[:, torch.arange(ids.shape[1], device=ids.device) % args.segment < args.period] = -100
    return labels


def chance_loss(args) -> float:
    """The loss of a uniform guess among 1..vocab-1, where the curves start."""
    return math.log(args.vocab - 1) if args.vocab > 2 else 0.0


def train(args, impl: str, torch) -> Dict[str, object]:
    from mla_cupy.integrations import transformers as mt

    mt.register()
    model = build_model(args, torch)
    model.set_attn_implementation(impl)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, args.beta2))
    warm = args.lr_warmup
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    cuda = args.device != "cpu"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses: List[float] = []
    times: List[float] = []
    for step in range(args.steps):
        ids = batch(args, step, torch)
        labels = targets(args, ids, torch)
        t0 = time.perf_counter()
        loss = model(ids, labels=labels, use_cache=False).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
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
    print(f"{args.layers} layers, hidden {args.hidden}, H = {args.heads}, {args.tokens} tokens, {args.steps} steps "
          f"(lr {args.lr:g}, beta2 {args.beta2:g}, {args.lr_warmup} warm-up); {info.get('device')}")
    print(f"task: a pattern of {args.period} tokens repeated in each segment of {args.segment}; the loss over the "
          f"tokens after each segment's first period, ln({args.vocab - 1}) = {chance_loss(args):.3f} at chance")
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
        ax.axhline(chance_loss(args), color="gray", ls=":", lw=1, label="chance")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(f"period {args.period} in segments of {args.segment}, {args.tokens} tokens, H = {args.heads}; "
                     f"{info.get('device')}, {info.get('date', '')} {info.get('commit', '')}".strip(), fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

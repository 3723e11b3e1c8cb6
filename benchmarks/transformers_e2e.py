"""Prefill latency of a DeepSeek-V3-shaped model in transformers: the ``mla_cupy`` attention backend
(``mla_cupy.integrations.transformers``) against ``sdpa`` and ``eager``.

    python benchmarks/transformers_e2e.py --json e2e.json            # 1k, 4k and 16k tokens
    python benchmarks/transformers_e2e.py --tokens 1024 --rounds 3   # one length

The model has DeepSeek V3's attention (hidden 7168, H = 128, q_lora_rank 1536, kv_lora_rank 512,
qk_nope 128, qk_rope 64, v_head 128) in a few decoder layers with a small dense MLP and no experts,
random weights in bfloat16 and a small vocabulary, so that it fits one GPU. A prefill is one
sequence of N tokens through the decoder without a cache (``use_cache=False``), timed by the wall
clock between device synchronizations, as a caller sees it.

For each length every backend first runs once and must agree with the reference backend
(``--reference``, default sdpa): the largest absolute difference of the last hidden state over its
largest absolute value at most ``--tol``, or twice eager's difference where eager ran. A backend
that disagrees stops the script (exit status 1) before that length is timed. Then ``--rounds``
interleaved rounds run each backend once, in alternating order; the median per backend is
reported. A backend that runs out of memory (eager at 16k tokens: its float32 scores alone take
128 x 16384^2 x 4 bytes) is recorded as such and left out of the rounds. ``--json`` is written
after each length.

``--device cpu`` with a small ``--hidden`` / ``--heads`` runs the same steps without a GPU (the
``mla_cupy`` backend then runs the float64 reference): a check of this script, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

#: DeepSeek V3's attention dimensions (the kernel's: 192-wide q/k heads, 128-wide values).
ATTENTION = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
IMPLS = ("mla_cupy", "sdpa", "eager")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line (see ``--help``); ``--tokens`` and ``--impls`` become lists."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,4096,16384", help="comma-separated prompt lengths (default: %(default)s)")
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma-separated attention backends, of "
                    f"{', '.join(IMPLS)} (default: %(default)s)")
    ap.add_argument("--reference", default="sdpa", choices=IMPLS, help="the backend the others must agree with")
    ap.add_argument("--tol", type=float, default=2e-2, help="agreement bound (relative max difference, default 2e-2)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per length (default 5)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    ap.add_argument("--intermediate", type=int, default=2048, help="the dense MLP's width (default 2048)")
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default 4096)")
    ap.add_argument("--hidden", type=int, default=7168, help="hidden size (default 7168, DeepSeek V3's)")
    ap.add_argument("--heads", type=int, default=128, help="attention heads (default 128, DeepSeek V3's)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a check of the script, not a measurement)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_path", default=None, help="write the results to this JSON file")
    args = ap.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    bad = [i for i in args.impls if i not in IMPLS]
    if bad or not args.impls:
        ap.error(f"--impls: expected names of {', '.join(IMPLS)}, got {args.impls}")
    if args.reference not in args.impls:
        ap.error(f"--reference: {args.reference} is not one of --impls {args.impls}")
    if not args.tokens or min(args.tokens) < 1:
        ap.error(f"--tokens: expected positive lengths, got {args.tokens}")
    for name in ("rounds", "layers", "intermediate", "vocab", "hidden", "heads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: expected a positive int, got {getattr(args, name)}")
    return args


def model_config(args: argparse.Namespace) -> Dict[str, object]:
    """The keywords of ``DeepseekV3Config``: DeepSeek V3's attention (:data:`ATTENTION`, ``--heads``
    and ``--hidden``), ``--layers`` dense decoder layers (``first_k_dense_replace`` = all of them,
    so no expert is built) of MLP width ``--intermediate``, positions for the longest prompt."""
    return dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                num_hidden_layers=args.layers, first_k_dense_replace=args.layers, num_attention_heads=args.heads,
                num_key_value_heads=args.heads, max_position_embeddings=max(args.tokens), n_routed_experts=8,
                num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=64, **ATTENTION)


def relative_error(x, ref) -> float:
    """``max |x - ref| / max |ref|`` in float32."""
    x, ref = x.float(), ref.float()
    return float((x - ref).abs().max() / ref.abs().max())


def _out_of_memory(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, (torch.OutOfMemoryError, MemoryError))


def run(args: argparse.Namespace, checkpoint: Optional[Callable[[dict], None]] = None) -> dict:
    """Build the model, then per length: the agreement check, the interleaved rounds. Returns the
    results (see :func:`format_table`), also given to ``checkpoint`` after each length; raises
    ``SystemExit(1)`` when a backend disagrees. Where the reference backend ran out of memory, the
    first backend of ``--impls`` that ran is the reference of that length (``reference`` in its rows)."""
    import torch
    import transformers
    from transformers import DeepseekV3Config, DeepseekV3Model

    import mla_cupy
    from mla_cupy.integrations import transformers as mt

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("transformers_e2e.py: no CUDA device (torch.cuda.is_available() is False); "
                         "--device cpu with a small --hidden / --heads checks the script without one")
    mt.register()
    cfg = model_config(args)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = DeepseekV3Model(DeepseekV3Config(**cfg)).to(getattr(torch, args.dtype)).eval()

    info = dict(device=torch.cuda.get_device_name(device) if cuda else "cpu", torch=torch.__version__,
                transformers=transformers.__version__, mla_cupy=mla_cupy.__version__, dtype=args.dtype,
                config=cfg, reference=args.reference, rounds=args.rounds, date=time.strftime("%Y-%m-%d %H:%M:%S"))

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def forward(impl, ids):
        model.set_attn_implementation(impl)
        with torch.inference_mode():
            return model(input_ids=ids, use_cache=False).last_hidden_state

    results: List[dict] = []
    for n in args.tokens:
        gen = torch.Generator(device=device).manual_seed(args.seed + n)
        ids = torch.randint(0, args.vocab, (1, n), device=device, generator=gen)
        status, outs = {}, {}
        for impl in args.impls:  # the first run of each backend: compiles, warms up, gives its output
            try:
                outs[impl] = forward(impl, ids)
                sync()
                status[impl] = "ok"
            except Exception as exc:
                if not _out_of_memory(exc):
                    raise
                status[impl] = "out of memory"
                outs.pop(impl, None)
                if cuda:
                    torch.cuda.empty_cache()
        # the reference, or where it ran out of memory the first backend that ran
        reference = next((i for i in [args.reference] + args.impls if i in outs), None)
        if reference is None:
            raise SystemExit(f"transformers_e2e.py: no backend ran at {n} tokens ({status})")
        errors = {impl: relative_error(out, outs[reference]) for impl, out in outs.items()}
        bound = max(args.tol, 2 * errors["eager"]) if "eager" in errors and reference != "eager" else args.tol
        wrong = {impl: e for impl, e in errors.items() if not e <= bound}
        if wrong:
            raise SystemExit(f"transformers_e2e.py: at {n} tokens {wrong} differ from {reference} by more than "
                             f"{bound:.3g} (max |difference| / max |{reference}|); this length was not timed")
        del outs
        timed = [impl for impl in args.impls if status[impl] == "ok"]
        times: Dict[str, List[float]] = {impl: [] for impl in timed}
        for r in range(args.rounds):
            for impl in (timed if r % 2 == 0 else timed[::-1]):
                sync()
                t0 = time.perf_counter()
                forward(impl, ids)
                sync()
                times[impl].append((time.perf_counter() - t0) * 1e3)
        for impl in args.impls:
            ms = times.get(impl, [])
            results.append(dict(tokens=n, impl=impl, status=status[impl], ms=statistics.median(ms) if ms else None,
                                ms_all=ms, reference=reference, err_vs_reference=errors.get(impl), bound=bound))
        if cuda:
            torch.cuda.empty_cache()
        if checkpoint is not None:
            checkpoint(dict(info, results=results))
    return dict(info, results=results)


def format_table(result: dict) -> str:
    """One row per (tokens, backend): median ms, smallest and largest, the time over mla_cupy's, and
    the difference from the reference backend of that length (max |difference| / max |reference|)."""
    ours = {r["tokens"]: r["ms"] for r in result["results"] if r["impl"] == "mla_cupy"}
    head = ["tokens", "backend", "ms (median)", "min", "max", "x mla_cupy", "diff", "vs", "status"]
    body = []
    for r in result["results"]:
        ms, base = r["ms"], ours.get(r["tokens"])
        body.append([str(r["tokens"]), r["impl"], "" if ms is None else f"{ms:.2f}",
                     f"{min(r['ms_all']):.2f}" if r["ms_all"] else "", f"{max(r['ms_all']):.2f}" if r["ms_all"] else "",
                     f"{ms / base:.2f}" if ms and base else "",
                     "" if r["err_vs_reference"] is None else f"{r['err_vs_reference']:.2e}", r["reference"],
                     r["status"]])
    widths = [max(len(h), *(len(c[i]) for c in body)) if body else len(h) for i, h in enumerate(head)]

    def fmt(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    cfg = result["config"]
    title = (f"{result['device']}, {result['dtype']}: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
             f"H = {cfg['num_attention_heads']}, MLP {cfg['intermediate_size']}; median of {result['rounds']} rounds")
    return "\n".join([title, fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(c) for c in body])


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)

    def save(result: dict) -> None:
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump(result, f, indent=1)

    print(format_table(run(args, checkpoint=save)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The eager PyTorch side of bench_wan_step: diffusers' WanTransformer3DModel at the sizes bench_wan_step uses
(Wan2.1-1.3B's width, 2 blocks by default, one latent clip of 16 x 2 x 16 x 16, 64 text tokens of 4096), trained
on the CPU with the same step: flow-matching noise, forward, MSE against the velocity, backward,
clip_grad_norm_(1.0), torch.optim.AdamW (fused on the CPU by default) — median step time after warm-up, and its
optimizer part. Run it beside build/bin/bench_wan_step with the same threads; docs/benchmarks.md has the figures.

    python3 -m venv /tmp/fixtures-venv && /tmp/fixtures-venv/bin/pip install -r tools/fixtures-requirements.txt
    /tmp/fixtures-venv/bin/python benchmarks/wan_step_diffusers.py [--layers 2] [--threads 2] [--optimizer fused]

Not part of CI (it needs Python, torch and diffusers).
"""

import argparse
import json
import statistics
import time

import torch
from diffusers import WanTransformer3DModel


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--frames", type=int, default=2)
    p.add_argument("--height", type=int, default=16)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--optimizer", choices=["fused", "foreach", "for-loop"], default="fused",
                   help="torch.optim.AdamW's implementation (fused: one kernel over all parameters)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(3)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                                  out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=a.layers,
                                  cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)
    model.train()
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[a.optimizer]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, **impl)
    torch.manual_seed(7)
    x0 = torch.randn(1, 16, a.frames, a.height, a.width)
    text = 0.1 * torch.randn(1, a.text_tokens, 4096)
    step_s, optimizer_s = [], []
    for s in range(a.warmup + a.steps):
        start = time.perf_counter()
        noise = torch.randn_like(x0)
        sigma = torch.rand(1)
        xt = (1 - sigma) * x0 + sigma * noise
        out = model(xt, sigma * 1000, text, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(out, noise - x0)
        loss.backward()
        loss.item()
        optimizer_start = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if s >= a.warmup:
            optimizer_s.append(time.perf_counter() - optimizer_start)
            step_s.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    print(f"diffusers {a.layers} block(s), {params} parameters, torch {torch.__version__}, {a.threads} threads, "
          f"AdamW {a.optimizer}: {statistics.median(step_s):.3f} s/step (optimizer {statistics.median(optimizer_s):.3f} s)")
    print(json.dumps({"bench": "wan_step_diffusers", "layers": a.layers, "threads": a.threads, "optimizer": a.optimizer,
                      "params": params, "step_s": round(statistics.median(step_s), 4),
                      "optimizer_s": round(statistics.median(optimizer_s), 4)}))


if __name__ == "__main__":
    main()

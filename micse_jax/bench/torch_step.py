"""The PyTorch baseline: the same miCSE step written with HF `transformers.BertModel`.

Eager attention (AMI needs the probabilities), two dropout views in one forward, InfoNCE with
384 queue negatives, AMI over 150 shared Gumbel-top-k samples of adjacent head pairs of the
last four layers, AdamW with gradient clipping, EMA momentum encoder (dropout 0.3), enqueue.
bfloat16/float16 use `torch.autocast` (float16 with `GradScaler`, PyTorch's loss scaling).
"""
from __future__ import annotations

import copy
import time

from micse_jax.optional import require


def time_steps(step, n_warmup: int, n: int) -> list[float]:
  """Runs `step` n_warmup times untimed, then n times; returns the n wall times (s)."""
  for _ in range(n_warmup):
    step()
  times = []
  for _ in range(n):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
  return times


def _torch_ami(torch, att, mask, n: int):
  """AMI of att `[L, 2B, H, T, T]` (view 1 rows first): adjacent head pairs, m = 150 shared samples."""
  a1, a2 = att[:, :n], att[:, n:]
  shape = a1.shape
  s1 = a1.reshape(shape[0], n, shape[2] // 2, -1)
  s2 = a2.reshape(shape[0], n, shape[2] // 2, -1)
  cell = (mask[:, :, None] * mask[:, None, :]).bool().reshape(n, -1).repeat(1, 2)
  valid = cell[None, :, None] & (s1 > 0) & (s2 > 0)
  scores = torch.where(valid, -torch.log(-torch.log(torch.rand_like(s1).clamp_min(1e-20))), -1e9)
  idx = scores.topk(150, dim=-1).indices
  w = valid.gather(-1, idx).float()
  x1 = torch.log(s1.gather(-1, idx).clamp_min(1e-12))
  x2 = torch.log(s2.gather(-1, idx).clamp_min(1e-12))
  ws = w.sum(-1).clamp_min(1)
  m1, m2 = (w * x1).sum(-1) / ws, (w * x2).sum(-1) / ws
  d1, d2 = x1 - m1[..., None], x2 - m2[..., None]
  rho = (w * d1 * d2).sum(-1) / ((w * d1 * d1).sum(-1) * (w * d2 * d2).sum(-1)).clamp_min(1e-12).sqrt()
  return (-0.5 * torch.log(1 - (rho * rho).clamp(max=1 - 1e-4))).mean()


def torch_benchmark(model_dir: str, batch: dict, dtype: str, warmup: int, steps: int):
  """Median-able step times (s) of the PyTorch miCSE step, and peak CUDA memory (None on CPU)."""
  import transformers
  torch = require("torch", "the PyTorch baseline of the bench")
  device = "cuda" if torch.cuda.is_available() else "cpu"
  model = transformers.BertModel.from_pretrained(model_dir, attn_implementation="eager").to(device).train()
  hidden, layers = model.config.hidden_size, model.config.num_hidden_layers
  mlp = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Tanh()).to(device)
  momentum = copy.deepcopy(model)
  for m in momentum.modules():
    if isinstance(m, torch.nn.Dropout):
      m.p = 0.3
  for p in momentum.parameters():
    p.requires_grad_(False)
  params = list(model.parameters()) + list(mlp.parameters())
  opt = torch.optim.AdamW(params, lr=3e-5, weight_decay=0.0)
  queue = torch.nn.functional.normalize(torch.randn(384, hidden, device=device), dim=-1)
  ptr = [0]
  tokens = ("input_ids", "attention_mask", "token_type_ids")
  b = {k: torch.tensor(batch[k], dtype=torch.long, device=device) for k in tokens}
  two = {k: torch.cat([v, v]) for k, v in b.items()}
  n = b["input_ids"].shape[0]
  half = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
  autocast = torch.autocast(device, dtype=half or torch.bfloat16, enabled=half is not None)
  scaler = torch.amp.GradScaler(device, enabled=dtype == "float16")  # PyTorch's loss scaling

  def step():
    with autocast:
      out = model(**two, output_attentions=True)
      z = mlp(out.last_hidden_state[:, 0]).float()
      z1, z2 = torch.nn.functional.normalize(z, dim=-1).chunk(2)
      logits = torch.cat([z1 @ z2.T, z1 @ queue.T], dim=1) / 0.05
      loss = torch.nn.functional.cross_entropy(logits, torch.arange(n, device=device))
      att = torch.stack(out.attentions[max(layers - 4, 0):]).float()
      loss = loss - 2.5e-3 * _torch_ami(torch, att, b["attention_mask"], n)
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    scaler.step(opt)
    scaler.update()
    with torch.no_grad(), autocast:
      for pm, po in zip(momentum.parameters(), model.parameters()):
        pm.mul_(0.995).add_(po.detach(), alpha=0.005)
      k = torch.nn.functional.normalize(mlp(momentum(**b).last_hidden_state[:, 0]).float(), dim=-1)
      slots = (ptr[0] + torch.arange(n, device=device)) % queue.shape[0]
      queue[slots] = k
      ptr[0] = (ptr[0] + n) % queue.shape[0]
    loss.item()  # synchronise

  if device == "cuda":
    torch.cuda.reset_peak_memory_stats()
  times = time_steps(step, warmup, steps)
  peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
  return times, peak

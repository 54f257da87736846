"""Benchmark: one miCSE update step in micse_jax vs an equivalent PyTorch step, same process.

    python benchmarks/train_step_bench.py --model bert-base --batch_size 50 --steps 20

`--model` is a HF directory or `bert-base` / `minilm` / `tiny` (random weights of that shape
for the first and last, the shipped checkpoint for `minilm`: no download needed). Reports step
time (median), sentences/s, peak memory and, on GPU, MFU; the PyTorch baseline is HF
`BertModel` (eager attention, needed for AMI) with the same objective: two dropout views,
InfoNCE + queue, AMI over sampled attention cells, AdamW, EMA momentum encoder, enqueue.
Writes a JSON line to stdout (and to --output when given).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Peak dense bf16 / fp32 tensor-core throughput, for MFU.
PEAK_FLOPS = {"H100": {"bfloat16": 989e12, "float32": 494e12}, "H200": {"bfloat16": 989e12, "float32": 494e12}}
SHAPES = {"bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
          "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)}


def model_dir_for(name: str) -> str:
  if os.path.isdir(name):
    return name
  if name == "minilm":
    from configs.default import shipped_minilm_dir
    return shipped_minilm_dir()
  import transformers
  path = tempfile.mkdtemp(prefix=f"bench_{name}_")
  transformers.BertModel(transformers.BertConfig(**SHAPES[name])).save_pretrained(path)
  return path


def random_batch(batch_size: int, length: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  lengths = rng.integers(length // 2, length + 1, batch_size)
  ids = rng.integers(1000, vocab, (batch_size, length)).astype(np.int32)
  mask = (np.arange(length)[None] < lengths[:, None]).astype(np.int32)
  return {"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


def bench_config(args, model_dir, num_layers):
  from configs import micse
  c = micse.get_config()
  c.ami.layers = tuple(range(-min(4, num_layers), 0))  # the last four layers (or all)
  c.model.name_or_path, c.model.dtype = model_dir, args.dtype
  c.batch_size, c.model.max_length = args.batch_size, args.max_length
  c.num_train_steps = 10_000
  return c


def time_steps(step, n_warmup: int, n: int) -> list[float]:
  for _ in range(n_warmup):
    step()
  times = []
  for _ in range(n):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
  return times


def jax_benchmark(args, model_dir, batch):
  from micse_jax.models.heads import MLPHead
  from micse_jax.models.loading import load_pretrained
  from micse_jax.training import mesh as mesh_lib
  from micse_jax.training.optim import learning_rate_schedule, make_optimizer
  from micse_jax.training.state import create_train_state
  from micse_jax.training.step import build_networks, make_train_step
  _, enc, bert_config, _ = load_pretrained(model_dir)
  config = bench_config(args, model_dir, bert_config.num_hidden_layers)
  head = MLPHead(bert_config.hidden_size).init(jax.random.PRNGKey(0), jnp.zeros((1, bert_config.hidden_size)))
  tx = make_optimizer(config)
  state = create_train_state({"encoder": enc, "head": head["params"]}, tx, seed=0, momentum=True,
                             queue_size=config.momentum.queue_size, dim=bert_config.hidden_size)
  mesh = mesh_lib.data_mesh()
  sharding = jax.tree.map(lambda _: mesh_lib.replicated(mesh), state)
  state = jax.device_put(state, sharding)
  fn = jax.jit(make_train_step(config, build_networks(config, bert_config), tx, learning_rate_schedule(config)),
               in_shardings=(sharding, mesh_lib.batch_sharded(mesh)), donate_argnums=0)
  ids = np.arange(len(batch["input_ids"]), dtype=np.int32)  # distinct sentences: nothing masked
  gbatch = mesh_lib.global_batch({**batch, "sentence_ids": ids}, mesh)
  compiled = fn.lower(state, gbatch).compile()
  flops = (compiled.cost_analysis() or {}).get("flops", float("nan"))
  box = [state]

  def step():
    box[0], metrics = compiled(box[0], gbatch)
    jax.block_until_ready(metrics["loss"])

  times = time_steps(step, args.warmup, args.steps)
  return times, flops


def torch_benchmark(args, model_dir, batch):
  import torch
  import transformers
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
  b = {k: torch.tensor(v, dtype=torch.long, device=device) for k, v in batch.items()}
  two = {k: torch.cat([v, v]) for k, v in b.items()}
  n = b["input_ids"].shape[0]
  autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")

  def ami(att, mask):  # att [L, 2B, H, T, T]: adjacent head pairs, m = 150 shared samples
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

  def step():
    with autocast:
      out = model(**two, output_attentions=True)
      z = mlp(out.last_hidden_state[:, 0]).float()
      z1, z2 = torch.nn.functional.normalize(z, dim=-1).chunk(2)
      logits = torch.cat([z1 @ z2.T, z1 @ queue.T], dim=1) / 0.05
      loss = torch.nn.functional.cross_entropy(logits, torch.arange(n, device=device))
      att = torch.stack(out.attentions[max(layers - 4, 0):]).float()
      loss = loss - 2.5e-3 * ami(att, b["attention_mask"])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
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
  times = time_steps(step, args.warmup, args.steps)
  peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
  return times, peak


def peak_memory_jax():
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def summarize(times, batch_size, dtype, flops=None, peak=None):
  med = statistics.median(times)
  out = {"step_ms": 1e3 * med, "sentences_per_s": batch_size / med, "peak_bytes": peak}
  kind = jax.devices()[0].device_kind
  for name, table in PEAK_FLOPS.items():
    if name in kind and flops and np.isfinite(flops):
      out["mfu"] = flops / med / table[dtype]
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="bert-base")
  p.add_argument("--batch_size", type=int, default=50)
  p.add_argument("--max_length", type=int, default=32)
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--no_torch", action="store_true")
  p.add_argument("--output")
  args = p.parse_args(argv)
  model_dir = model_dir_for(args.model)
  import transformers
  vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
  batch = random_batch(args.batch_size, args.max_length, vocab)
  jt, flops = jax_benchmark(args, model_dir, batch)
  result = {"model": args.model, "batch_size": args.batch_size, "max_length": args.max_length,
            "dtype": args.dtype, "device": jax.devices()[0].device_kind, "num_devices": jax.device_count(),
            "jax": summarize(jt, args.batch_size, args.dtype, flops, peak_memory_jax()), "step_flops": flops}
  if result["jax"]["peak_bytes"] is None:
    result["host_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  if not args.no_torch:
    tt, tpeak = torch_benchmark(args, model_dir, batch)
    result["torch"] = summarize(tt, args.batch_size, args.dtype, flops, tpeak)
    result["speedup_vs_torch"] = result["torch"]["step_ms"] / result["jax"]["step_ms"]
  line = json.dumps(result)
  print(line)
  if args.output:
    with open(args.output, "w", encoding="utf-8") as f:
      f.write(line + "\n")
  return result


if __name__ == "__main__":
  main()

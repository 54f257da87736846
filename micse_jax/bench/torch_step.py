"""The PyTorch peers: the same miCSE step written with HF `transformers.BertModel`, two ways.

`eager` is the public code's way ("the public code"): eager attention everywhere (AMI needs the
probabilities), per-parameter AdamW, a Python-loop EMA. `compiled` is the best PyTorch we know
for the same step: the loss (forward, InfoNCE, AMI) under `torch.compile`, PyTorch's SDPA kernel
in every layer whose probabilities AMI does not read (eager attention kept in the last four),
fused AdamW (`fused=True`), and the EMA as two `torch._foreach` calls.

Both: two dropout views in one forward, InfoNCE with 384 queue negatives, AMI over 150 shared
Gumbel-top-k samples of adjacent head pairs of the last four layers, gradient clipping, EMA
momentum encoder (dropout 0.3), enqueue. bfloat16/float16 use `torch.autocast` (float16 with
`GradScaler`, PyTorch's loss scaling, whose step reads the found-inf flag: one device wait per
step that the micse_jax step does not have). The hyper-parameters are those of
`configs/default.py` (miCSE's); `tests/torch_peer_test.py` checks that the loss and its terms
equal the micse_jax step's on the same weights, batch and queue with dropout off.

`dispatch()` launches one step without waiting for it (the pipelined timing of
`bench/timing.py`); `step()` waits and returns the loss.
"""
from __future__ import annotations

import copy

from micse_jax.bench import timing
from micse_jax.optional import require

TORCH_MODES = ("eager", "compiled")  # `bench --torch_mode`'s choices
AMI_LAYERS = 4  # AMI reads the last four layers' attention probabilities
QUEUE_SIZE = 384
TEMPERATURE, AMI_WEIGHT = 0.05, 2.5e-3  # tau of Eq. 2, lambda of Eq. 5


def _torch_ami(torch, att, mask, n: int):
  """Mean AMI (Eq. 4) of att `[L, 2B, H, T, T]` (view 1 rows first): adjacent head pairs,
  m = 150 shared samples of the cells real in both query and key and > 0 in both views."""
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


def load_bert(model_dir: str, device: str, mode: str):
  """HF BertModel in training mode; `compiled`: SDPA in every layer AMI does not read.

  The model is built with eager attention (so the additive mask is the one eager needs, which
  SDPA also accepts); the first L − 4 layers' self-attention then gets a config copy naming
  `sdpa`, which transformers' attention interface looks up per call.
  """
  import transformers  # a required package, but a slow import: only when a PyTorch peer runs
  model = transformers.BertModel.from_pretrained(model_dir, attn_implementation="eager").to(device).train()
  if mode == "compiled":
    layers = model.encoder.layer
    for layer in layers[:max(len(layers) - AMI_LAYERS, 0)]:
      fast = copy.copy(model.config)
      fast._attn_implementation = "sdpa"
      layer.attention.self.config = fast
  return model


class TorchMicseStep:
  """The PyTorch miCSE step (`mode` eager or compiled) on one fixed batch; `step()` runs one."""

  def __init__(self, model_dir: str, batch: dict, dtype: str, mode: str = "eager", device: str | None = None):
    torch = self.torch = require("torch", "the PyTorch baseline of the bench")
    if mode not in TORCH_MODES:
      raise ValueError(f"torch mode {mode!r}: expected one of {TORCH_MODES}")
    self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    self.mode, self.model = mode, load_bert(model_dir, self.device, mode)
    hidden = self.model.config.hidden_size
    self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Tanh()).to(self.device)
    self.momentum = copy.deepcopy(self.model)
    for m in self.momentum.modules():
      if isinstance(m, torch.nn.Dropout):
        m.p = 0.3
    for p in self.momentum.parameters():
      p.requires_grad_(False)
    self.params = list(self.model.parameters()) + list(self.mlp.parameters())
    self.opt = torch.optim.AdamW(self.params, lr=3e-5, weight_decay=0.0, fused=mode == "compiled")
    self.queue = torch.nn.functional.normalize(torch.randn(QUEUE_SIZE, hidden, device=self.device), dim=-1)
    self.ptr = 0
    self.batch = {k: torch.tensor(batch[k], dtype=torch.long, device=self.device)
                  for k in ("input_ids", "attention_mask", "token_type_ids")}
    half = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    self.autocast = lambda: torch.autocast(self.device, dtype=half or torch.bfloat16, enabled=half is not None)
    self.scaler = torch.amp.GradScaler(self.device, enabled=dtype == "float16")  # PyTorch's loss scaling
    self.loss_fn = torch.compile(self.loss) if mode == "compiled" else self.loss
    self.keys_fn = torch.compile(self.momentum_keys) if mode == "compiled" else self.momentum_keys

  def terms(self, batch: dict, queue) -> dict:
    """{"infonce": InfoNCE over two dropout views with `queue` negatives (miCSE Eq. 2),
    "ami_mi": the mean AMI between the views' attention (Eq. 4)}."""
    torch, n = self.torch, batch["input_ids"].shape[0]
    two = {k: torch.cat([v, v]) for k, v in batch.items()}
    with self.autocast():
      out = self.model(**two, output_attentions=True)
      z = self.mlp(out.last_hidden_state[:, 0]).float()
      z1, z2 = torch.nn.functional.normalize(z, dim=-1).chunk(2)
      logits = torch.cat([z1 @ z2.T, z1 @ queue.T], dim=1) / TEMPERATURE
      infonce = torch.nn.functional.cross_entropy(logits, torch.arange(n, device=z.device))
      att = torch.stack([a for a in out.attentions if a is not None][-AMI_LAYERS:]).float()
      return {"infonce": infonce, "ami_mi": _torch_ami(torch, att, batch["attention_mask"], n)}

  def loss(self, batch: dict, queue):
    """InfoNCE minus λ·AMI (miCSE Eq. 5)."""
    t = self.terms(batch, queue)
    return t["infonce"] - AMI_WEIGHT * t["ami_mi"]

  def momentum_keys(self, batch: dict):
    """The momentum encoder's L2-normalised [CLS] embeddings through the online MLP head."""
    with self.autocast():
      return self.torch.nn.functional.normalize(self.mlp(self.momentum(**batch).last_hidden_state[:, 0]).float(),
                                                dim=-1)

  def ema(self) -> None:
    """target ← 0.995·target + 0.005·online: a Python loop (eager) or two `_foreach` kernels' worth."""
    online, target = list(self.model.parameters()), list(self.momentum.parameters())
    if self.mode == "compiled":
      self.torch._foreach_mul_(target, 0.995)
      self.torch._foreach_add_(target, online, alpha=0.005)
      return
    for pm, po in zip(target, online):
      pm.mul_(0.995).add_(po.detach(), alpha=0.005)

  def dispatch(self):
    """Launches one optimizer step, EMA and enqueue; returns the loss tensor without waiting."""
    torch = self.torch
    loss = self.loss_fn(self.batch, self.queue)
    self.opt.zero_grad(set_to_none=True)
    self.scaler.scale(loss).backward()
    self.scaler.unscale_(self.opt)
    torch.nn.utils.clip_grad_norm_(self.params, 1.0, foreach=True if self.mode == "compiled" else None)
    self.scaler.step(self.opt)
    self.scaler.update()
    with torch.no_grad():
      self.ema()
      keys = self.keys_fn(self.batch)
      n = keys.shape[0]
      self.queue[(self.ptr + torch.arange(n, device=self.device)) % QUEUE_SIZE] = keys
      self.ptr = (self.ptr + n) % QUEUE_SIZE
    return loss

  def wait(self, _loss=None) -> None:
    """Blocks until the device has run every dispatched step (nothing to wait for on a CPU)."""
    if self.device == "cuda":
      self.torch.cuda.synchronize()

  def step(self) -> float:
    """One step, waited for; returns the loss."""
    return float(self.dispatch().item())


def torch_benchmark(model_dir: str, batch: dict, dtype: str, warmup: int, steps: int, rounds: int,
                    mode: str = "eager") -> dict:
  """The PyTorch miCSE step in `mode` timed as `bench/timing.measure` times (blocked and
  pipelined ms), with `peak_device_bytes` (CUDA's peak allocation; None on a CPU)."""
  step = TorchMicseStep(model_dir, batch, dtype, mode)
  torch = step.torch
  if step.device == "cuda":
    torch.cuda.reset_peak_memory_stats()
  times = timing.measure(step.dispatch, step.wait, warmup, steps, rounds)
  peak = torch.cuda.max_memory_allocated() if step.device == "cuda" else None
  return dict(times, peak_device_bytes=peak)

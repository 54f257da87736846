"""Test helpers: tiny random HF checkpoints written to disk, PyTorch reference forwards, and
multi-device workers run in a subprocess."""
import json
import os
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout the tests live in


def run_module(module: str, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
  """`python -m module args...` from the checkout, with the checkout first on PYTHONPATH (unless `env`)."""
  env = env or {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
  return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=timeout, check=False)


SENTENCES = [
    "A man is playing a guitar.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Hello.",
    "Transformers encode sentences into vectors that capture their meaning.",
]


def shared_sentences(shared_data_dir, n=16):
  """First `n` non-empty lines of the shared wiki corpus, else the built-in sentences."""
  path = os.path.join(shared_data_dir or "", "corpus", "wiki1m_head.txt")
  if not os.path.isfile(path):
    return SENTENCES
  with open(path, encoding="utf-8") as f:
    return [line.strip() for line, _ in zip(f, range(4 * n)) if line.strip()][:n]


def write_tiny_hf_checkpoint(path, tokenizer_dir, model_type="bert", mlm=True, seed=0, **overrides):
  """Saves a randomly initialised 2-layer HF model (+ the tokenizer of `tokenizer_dir`)."""
  import torch
  import transformers
  torch.manual_seed(seed)
  kwargs = dict(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128, max_position_embeddings=128)
  kwargs.update(overrides)
  if model_type == "roberta":
    config = transformers.RobertaConfig(**kwargs, type_vocab_size=1, pad_token_id=0)
    model = transformers.RobertaModel(config, add_pooling_layer=True)
  else:
    config = transformers.BertConfig(**kwargs)
    model = transformers.BertForMaskedLM(config) if mlm else transformers.BertModel(config)
  with torch.no_grad():  # non-trivial LayerNorm / bias values so the mapping is really tested
    for name, p in model.named_parameters():
      if "LayerNorm" in name or name.endswith("bias"):
        p.add_(0.1 * torch.randn_like(p))
  model.save_pretrained(path, safe_serialization=True)
  transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
  return path


def torch_forward(model_dir, batch, mlm=False):
  """Reference forward with HF transformers in eval mode, eager attention, all outputs."""
  import torch
  import transformers
  cls = transformers.AutoModelForMaskedLM if mlm else transformers.AutoModel
  model = cls.from_pretrained(model_dir, attn_implementation="eager").eval()
  inputs = {k: torch.tensor(np.asarray(v), dtype=torch.long) for k, v in batch.items()}
  with torch.no_grad():
    return model(**inputs, output_attentions=True, output_hidden_states=True)


def fake_devices_env(devices: int, **extra: str) -> dict:
  """This process's environment for a subprocess with `devices` fake CPU devices: the suite's own XLA
  flags (`conftest.TEST_XLA_FLAGS`) kept, the device count added."""
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
  return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", **extra)


def run_device_worker(module: str, *args: str, devices: int = 4, timeout: int = 900) -> dict:
  """Runs `python -m module args...` with `devices` fake CPU devices (a fresh process: the device
  count is fixed at JAX's start) from the checkout; returns the JSON of its last output line."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = fake_devices_env(devices, PYTHONPATH=repo)
  out = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=repo, env=env, capture_output=True,
                       text=True, timeout=timeout)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])

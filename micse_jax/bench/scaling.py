"""What the miCSE step costs per device at cluster scale, read from the compiler (no step is run).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \
        python -m micse_jax.bench --collectives [--batch_size 512 --max_length 32]

For the current devices (fake CPU devices are fine) the trainer's step (`training/program.py`,
via `aot/compile.py`) of BERT-base (no download: shapes only, nothing is allocated) is lowered and
compiled for every memory layout — state replicated or sharded (`mesh.shard_state`), layers
rematerialised or not (`model.remat`) — and the report gives

  * the collectives of the optimised HLO by kind: count, bytes and largest result per device
    (`aot/collectives.py`);
  * the compiler's memory analysis per device: arguments (train state + batch), outputs,
    temporaries, and peak ≈ arguments + outputs − donated aliases + temporaries.

Neither depends on machine load. Compiling BERT-base at batch 512 takes minutes per layout on
a small CPU; `--collectives_layouts` picks a subset.
"""
from __future__ import annotations

import dataclasses

import jax

from micse_jax.aot import compile as aot_compile
from micse_jax.aot.collectives import collective_table
from micse_jax.aot.hlo_module import parse
from micse_jax.bench.jax_step import bench_config
from micse_jax.models.bert import BertConfig

LAYOUTS = ("replicated/none", "replicated/layer", "replicated/full",
           "sharded/none", "sharded/layer", "sharded/full")
MIB = 2 ** 20


def layout_config(layout: str, batch_size: int, max_length: int, dtype: str, num_layers: int = 12):
  """The bench's miCSE config (`bench/jax_step.bench_config`) in one layout ("replicated|sharded" /
  "none|layer|full"), its queue holding a batch (as the trainer asks)."""
  placement, remat = layout.split("/")
  config = bench_config("bert-base-uncased", num_layers, batch_size, max_length, dtype,
                        shard_state=placement == "sharded", remat=remat)
  config.momentum.queue_size = max(config.momentum.queue_size, batch_size)
  return config


def compile_step(layout: str, batch_size: int, max_length: int, dtype: str, bert_config=None):
  """The trainer's compiled step (`aot/compile.py`) of one layout (`layout_config`) for
  `jax.devices()`; BERT-base by default."""
  bert_config = bert_config or BertConfig()  # BertConfig(): bert-base-uncased
  config = layout_config(layout, batch_size, max_length, dtype, bert_config.num_hidden_layers)
  return aot_compile.compile_program(config, bert_config, jax.devices())[0]


@dataclasses.dataclass
class LayoutReport:
  """One compiled layout's figures: its name, collectives by kind (`aot/collectives.py`), memory per device."""
  layout: str
  collectives: dict
  memory: dict  # MiB per device


def memory_per_device(compiled) -> dict:
  """The compiler's buffer sizes for one device (`aot/compile.memory`), MiB."""
  return {k: v / MIB for k, v in aot_compile.memory(compiled).items()}


def measure(layouts=LAYOUTS, batch_size: int = 512, max_length: int = 32, dtype: str = "float32") -> list:
  """One `LayoutReport` per layout, compiled for `jax.devices()`."""
  reports = []
  for layout in layouts:
    if layout not in LAYOUTS:
      raise ValueError(f"unknown layout {layout!r}; expected some of {', '.join(LAYOUTS)}")
    compiled = compile_step(layout, batch_size, max_length, dtype)
    reports.append(LayoutReport(layout, collective_table(parse(compiled.as_text())), memory_per_device(compiled)))
    print(f"  compiled {layout}", flush=True)
  return reports


def report_lines(reports: list, batch_size: int, max_length: int, dtype: str) -> list[str]:
  """Markdown tables: collectives per layout, then memory per device."""
  kinds = list(reports[0].collectives)
  lines = [f"miCSE step, BERT-base, batch {batch_size} x {max_length} tokens, {dtype}, "
           f"{jax.device_count()} {jax.devices()[0].platform} devices (compiled, not run)", "",
           "| layout (state/remat) | " + " | ".join(f"{k} count / MiB" for k in kinds) + " | largest (MiB) |",
           "|---|" + "---:|" * (len(kinds) + 1)]
  for r in reports:
    cells = [f"{r.collectives[k]['count']} / {r.collectives[k]['bytes'] / MIB:.1f}" for k in kinds]
    largest = max(r.collectives[k]["max_bytes"] for k in kinds) / MIB
    lines.append(f"| {r.layout} | " + " | ".join(cells) + f" | {largest:.1f} |")
  lines += ["", "| layout (state/remat) | arguments | outputs | aliased | temporaries | peak (MiB / device) |",
            "|---|---:|---:|---:|---:|---:|"]
  for r in reports:
    m = r.memory
    lines.append(f"| {r.layout} | {m['arguments']:.0f} | {m['outputs']:.0f} | {m['aliased']:.0f} | "
                 f"{m['temporaries']:.0f} | {m['peak']:.0f} |")
  return lines


def run(layouts=LAYOUTS, batch_size: int = 512, max_length: int = 32, dtype: str = "float32") -> dict:
  """Measures, prints the tables, returns a JSON-able result."""
  reports = measure(layouts, batch_size, max_length, dtype)
  print("\n".join(report_lines(reports, batch_size, max_length, dtype)), flush=True)
  return {"devices": jax.device_count(), "platform": jax.devices()[0].platform, "batch_size": batch_size,
          "max_length": max_length, "dtype": dtype, "layouts": [dataclasses.asdict(r) for r in reports]}

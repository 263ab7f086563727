"""What the GPU check runs on: prints the versions it finds, then fails in seconds, naming what is
missing and how to bring it, if the machine cannot run the GPU tests.

Run by benchmarks/gpu_check.sh after the carried wheels are installed:

    python3 benchmarks/gpu_env.py [--dry-run] [--json versions.json]

With ``--dry-run`` a machine without a CUDA device passes (the GPU tests then skip with their
reason), and so does one without CuPy; with CuPy, the kernels of csrc/ are compiled to PTX by
NVRTC, which needs no device. Everything else is still required. Exit status: 0 ready, 2 something
is missing.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import importlib
import importlib.metadata
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEELS_HINT = (
    "it travels as a wheel: run `bash benchmarks/gpu_wheels.sh` on the development machine, then "
    "name .whl in the call's carry"
)
#: import name -> distribution, for the packages the lent machine is expected to have already
PRESENT = {
    "numpy": "numpy",
    "msgpack": "msgpack",
    "pytest": "pytest",
    "pytest_timeout": "pytest-timeout",
    "hypothesis": "hypothesis",
}


@dataclass
class Report:
    """The versions found and what is missing; ``missing`` entries name the way out."""

    versions: dict[str, Any] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)

    def need(self, what: str, why: str) -> None:
        self.missing.append(f"{what}: {why}")


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _ucx_version(nixl_module: Any) -> str | None:
    """The UCX that NIXL's wheel bundles (its libucp, already loaded by NIXL's bindings)."""
    here = os.path.dirname(os.path.abspath(nixl_module.__file__))
    for lib in sorted(glob.glob(here + ".libs/libucp*.so*")) or ["libucp.so.0"]:
        try:
            ucp = ctypes.CDLL(lib)
        except OSError:
            continue
        ucp.ucp_get_version_string.restype = ctypes.c_char_p
        return str(ucp.ucp_get_version_string().decode())
    return None


def check_torch(r: Report, dry_run: bool) -> None:
    try:
        import torch
    except ImportError as e:
        r.need("torch", f"does not import ({e}); the lent machine's python3 has it: run there")
        return
    r.versions["torch"] = torch.__version__
    r.versions["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        r.versions["devices"] = [
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
        ]
    elif not dry_run:
        why = "a CPU build of torch" if torch.version.cuda is None else "no device visible"
        r.need(
            "CUDA device",
            f"torch.cuda.is_available() is False ({why}); run on the lent GPU machine with its "
            "python3, or pass --dry-run to check everything else",
        )


def check_cupy(r: Report, dry_run: bool) -> None:
    no_device = r.versions.get("devices") is None
    try:
        import cupy
    except ImportError as e:
        if dry_run and no_device:
            r.versions["cupy"] = "absent (needed only with a CUDA device)"
        else:
            r.need("cupy", f"does not import ({e}); stream= compiles its kernels with CuPy")
        return
    r.versions["cupy"] = cupy.__version__
    if dry_run and no_device:
        check_ptx(r)
        return
    try:
        r.versions["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        r.versions["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
        from transport.cuda.stream import kernel_source

        mod = cupy.RawModule(code=kernel_source(), options=("--std=c++17",))
        mod.get_function("transport_ring")  # compiles csrc/stream_ops.cu with NVRTC
        r.versions["kernels"] = "csrc/stream_ops.cu compiled"
    except Exception as e:
        r.need(
            "CUDA kernels", f"CuPy could not compile csrc/stream_ops.cu: {type(e).__name__}: {e}"
        )


def check_ptx(r: Report) -> None:
    """Without a device: csrc/stream_ops.cu compiled to PTX by the NVRTC that CuPy finds, which
    needs no driver (loading the module does)."""
    from transport.cuda.stream import kernel_source

    try:
        from cupy_backends.cuda.libs import nvrtc

        prog = nvrtc.createProgram(kernel_source(), "stream_ops.cu", [], [])
    except Exception as e:  # no NVRTC here: nothing to say about the kernels
        r.versions["kernels"] = f"not compiled (no NVRTC: {type(e).__name__})"
        return
    try:
        nvrtc.compileProgram(prog, ["--std=c++17", "--gpu-architecture=compute_90"])
    except Exception as e:
        r.need(
            "CUDA kernels",
            f"NVRTC could not compile csrc/stream_ops.cu: {e}\n{nvrtc.getProgramLog(prog)}",
        )
        return
    major, minor = nvrtc.getVersion()
    r.versions["kernels"] = (
        f"csrc/stream_ops.cu compiled to PTX by NVRTC {major}.{minor} (no device to load it)"
    )


def check_nixl(r: Report) -> None:
    errors = []
    for name in ("nixl_cu13", "nixl"):
        try:
            mod = importlib.import_module(name)
            importlib.import_module(f"{name}._bindings")
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        dist = "nixl-cu13" if name == "nixl_cu13" else "nixl"
        r.versions["nixl"] = (
            f"{_dist_version(dist)} ({name} from {os.path.dirname(str(mod.__file__))})"
        )
        r.versions["ucx"] = _ucx_version(mod)
        return
    r.need("nixl", f"does not import ({'; '.join(errors)}); {WHEELS_HINT}")


def check_modules(r: Report) -> None:
    for module, dist in {**PRESENT, "redis": "redis", "rich": "rich"}.items():
        try:
            importlib.import_module(module)
        except ImportError as e:
            hint = WHEELS_HINT if dist not in PRESENT.values() else "add it to gpu_wheels.sh"
            r.need(dist, f"does not import ({e}); {hint}")
            continue
        r.versions[dist] = _dist_version(dist)


def check_carried(r: Report, folder: str) -> None:
    """Each wheel of ``folder`` must be what this process imports (installed by gpu_check.sh into
    a folder on PYTHONPATH, ahead of the machine's own packages)."""
    carried = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.whl"))):
        dist, version = os.path.basename(path).split("-")[:2]
        try:
            found = importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            r.need(dist, f"carried as {os.path.basename(path)} but not installed (see install.log)")
            continue
        where = str(found.locate_file(""))
        carried[dist] = f"{found.version} in {where}"
        if found.version != version:
            r.need(dist, f"carried {version}, but {found.version} from {where} is imported")
    r.versions["carried"] = carried


def check_transport(r: Report) -> None:
    try:
        import transport
        import transport.backends
    except ImportError as e:
        r.need("transport", f"does not import ({e}); install the tree: pip install --no-deps -e .")
        return
    where = os.path.dirname(os.path.abspath(transport.__file__))
    r.versions["transport"] = f"{transport.__version__} from {where}"
    if os.path.commonpath([where, ROOT]) != ROOT:
        r.need("transport", f"imported from {where}, not from this tree ({ROOT})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="pass without a CUDA device")
    ap.add_argument("--json", help="also write the versions found to this file")
    ap.add_argument("--carried", help="the folder of the wheels that gpu_check.sh installed")
    args = ap.parse_args()
    r = Report()
    r.versions["python"] = f"{platform.python_version()} ({sys.executable})"
    check_torch(r, args.dry_run)
    check_transport(r)
    check_cupy(r, args.dry_run)
    check_nixl(r)
    check_modules(r)
    if args.carried:
        check_carried(r, args.carried)
    for k, v in r.versions.items():
        print(f"gpu_check: {k} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": r.versions, "missing": r.missing}, f, indent=1)
    if r.missing:
        for m in r.missing:
            print(f"gpu_check: missing {m}", file=sys.stderr)
        return 2
    if args.dry_run and r.versions.get("devices") is None:
        print(
            "gpu_check: dry run without a CUDA device: the GPU tests skip, the benchmarks do not run"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

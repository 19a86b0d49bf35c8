"""Build and install megatron-hybrid.

The library is pure Python; the native ops in ``csrc/`` are optional:

- the CPU (C++) part is built when torch is importable at build time and a C++ compiler is found;
- the CUDA part is built when a CUDA toolkit is found (``CUDA_HOME`` or ``nvcc`` on ``PATH``), for the archs in
  ``TORCH_CUDA_ARCH_LIST`` (default ``9.0``, Hopper).

``MEGATRON_HYBRID_BUILD_CPP=0`` / ``MEGATRON_HYBRID_BUILD_CUDA=0`` turn either part off. A machine without a
compiler or CUDA never fails the install: the library then uses its pure-PyTorch reference ops. To build the
extension, install with ``--no-build-isolation`` so the build sees the torch you installed (an isolated build
would download another torch).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


def _flag(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def _extensions():
    """Return (ext_modules, cmdclass) for the native ops, or ([], {}) when they cannot be built here.

    Automatic builds never fail the install: a failed compile is reported and skipped (the extension is optional)
    and the library uses its reference ops. Setting ``MEGATRON_HYBRID_BUILD_CUDA=1`` explicitly asks for the CUDA
    kernels: then a missing toolkit, a CPU torch or a toolkit/torch CUDA major-version mismatch is an error.
    """
    import re
    import subprocess

    def nvcc_major(cuda_home):
        """Major version of the toolkit's nvcc, or None when it cannot be read."""
        try:
            out = subprocess.run([str(Path(cuda_home) / "bin" / "nvcc"), "--version"], capture_output=True,
                                 text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None
        match = re.search(r"release (\d+)\.", out)
        return int(match.group(1)) if match else None

    sources_cpp = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp"))
    sources_cu = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cu"))
    if not _flag("MEGATRON_HYBRID_BUILD_CPP") or not sources_cpp:
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("megatron-hybrid: torch is not importable at build time; skipping the native ops "
              "(install torch first and use --no-build-isolation to build them)", file=sys.stderr)
        return [], {}
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        print("megatron-hybrid: no C++ compiler found; skipping the native ops", file=sys.stderr)
        return [], {}
    cuda_required = "MEGATRON_HYBRID_BUILD_CUDA" in os.environ and _flag("MEGATRON_HYBRID_BUILD_CUDA")

    def skip_cuda(reason):
        if cuda_required:
            raise RuntimeError(f"megatron-hybrid: MEGATRON_HYBRID_BUILD_CUDA=1 but {reason}")
        print(f"megatron-hybrid: {reason}; building the CPU ops only", file=sys.stderr)
        return False

    cuda_home = cpp_extension.CUDA_HOME
    build_cuda = _flag("MEGATRON_HYBRID_BUILD_CUDA") and bool(sources_cu)
    if build_cuda and cuda_home is None:
        build_cuda = cuda_required and skip_cuda("no CUDA toolkit was found (set CUDA_HOME or put nvcc on PATH)")
    if build_cuda and torch.version.cuda is None:
        build_cuda = skip_cuda(f"a CUDA toolkit is at {cuda_home} but this torch ({torch.__version__}) is a CPU "
                               "build. Install a CUDA build of torch to get the CUDA kernels")
    if build_cuda:
        toolkit_major, torch_major = nvcc_major(cuda_home), int(torch.version.cuda.split(".")[0])
        if toolkit_major is not None and toolkit_major != torch_major:
            build_cuda = skip_cuda(f"the CUDA toolkit at {cuda_home} is CUDA {toolkit_major} but torch "
                                   f"{torch.__version__} was built with CUDA {torch.version.cuda}. Point CUDA_HOME "
                                   f"at a CUDA {torch_major}.x toolkit, or install a torch built for CUDA "
                                   f"{toolkit_major}")
    # No -std flag: torch's cpp_extension passes the standard its headers need (C++17 or C++20).
    cxx = ["-O3"]
    if build_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        ext = cpp_extension.CUDAExtension(
            "megatron_hybrid.kernels._C", sources_cpp + sources_cu,
            extra_compile_args={"cxx": cxx + ["-DMH_WITH_CUDA"], "nvcc": ["-O3", "-DMH_WITH_CUDA"]},
        )
    else:
        ext = cpp_extension.CppExtension("megatron_hybrid.kernels._C", sources_cpp, extra_compile_args={"cxx": cxx})
    ext.optional = not cuda_required

    class BuildExt(cpp_extension.BuildExtension.with_options(use_ninja=True)):
        """torch's build_ext (parallel ninja builds when ninja is installed) that skips a failed optional build,
        with a C++ compiler that links the shared libstdc++.

        setuptools skips optional extensions only on distutils' compile errors; torch's ninja path raises
        RuntimeError / CalledProcessError instead.
        """

        def build_extensions(self):
            _use_shared_libstdcxx(self.compiler)
            super().build_extensions()

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
                if not ext.optional:
                    raise
                print(f"megatron-hybrid: building {ext.name} failed ({exc}); the library will use its PyTorch "
                      "reference ops", file=sys.stderr)

    return [ext], {"build_ext": BuildExt}


def _links_shared_libstdcxx(cxx: str, link_args: list) -> bool:
    """Whether ``cxx`` (with ``link_args``) links a C++ shared object against the shared libstdc++.

    Unknown (no compiler answer) counts as yes: the real build then says what is wrong.
    """
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src, so = Path(tmp) / "probe.cpp", Path(tmp) / "probe.so"
        src.write_text("#include <sstream>\n#include <string>\n"
                       "std::string probe(unsigned long x) { std::ostringstream s; s << x; return s.str(); }\n")
        try:
            subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", str(so)] + link_args, check=True,
                           capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return True
        # DT_NEEDED names live in .dynstr; a statically linked libstdc++ leaves no such name behind.
        return b"libstdc++.so" in so.read_bytes()


#: Links the shared libstdc++ before anything the compiler adds: a later static copy then has nothing to supply.
SHARED_LIBSTDCXX = ["-Wl,-Bdynamic", "-lstdc++"]


def _use_shared_libstdcxx(compiler) -> None:
    """Make the extension use the process's shared libstdc++, not a private static copy.

    Found on the H200 image (torch 2.11+cu130, Python 3.12): its CXX and CC, /opt/gcc/bin/g++ and gcc, wrappers
    around Ubuntu's gcc 13.3, link libstdc++ statically into shared objects (the built extension had no NEEDED
    libstdc++.so.6). The extension then carries a second libstdc++ (its own locale and facet registry) beside the
    shared one that torch uses, and the first std::ostringstream it fills (the message of any TORCH_CHECK, in
    c10::str) reads facets the other copy registered: SIGSEGV in std::ostream::_M_insert instead of a
    RuntimeError. Any extension built with that compiler crashed the same way (a three-line TORCH_CHECK(false) op
    did). Remedies, in order: link ``-lstdc++`` dynamically first; else build with ``c++`` / ``g++`` from PATH
    (torch's ninja build reads ``CXX``, setuptools links with ``linker_so``).
    """
    if getattr(compiler, "compiler_type", "") != "unix":
        return
    # setuptools links C++ with compiler_cxx's program in place of linker_so's (distutils' link()).
    linker = (getattr(compiler, "compiler_cxx", None) or compiler.linker_so)[0]
    if _links_shared_libstdcxx(linker, []):
        return
    if _links_shared_libstdcxx(linker, SHARED_LIBSTDCXX):
        print(f"megatron-hybrid: {linker} links libstdc++ statically; linking the native ops against the shared "
              f"libstdc++ ({' '.join(SHARED_LIBSTDCXX)})", file=sys.stderr)
        compiler.set_executable("linker_so", list(compiler.linker_so) + SHARED_LIBSTDCXX)
        return
    for name in ("c++", "g++"):
        alternative = shutil.which(name)
        if alternative and os.path.realpath(alternative) != os.path.realpath(linker) \
                and _links_shared_libstdcxx(alternative, []):
            print(f"megatron-hybrid: {linker} links libstdc++ statically; building the native ops with "
                  f"{alternative}", file=sys.stderr)
            os.environ["CXX"] = alternative  # torch's ninja compile rules
            for attr in ("linker_so", "compiler_so", "compiler_cxx"):
                cmd = list(getattr(compiler, attr, None) or [])
                if cmd:
                    compiler.set_executable(attr, [alternative] + cmd[1:])
            return
    raise RuntimeError(f"megatron-hybrid: {linker} links libstdc++ statically into shared objects, which makes "
                       "exceptions from the native ops crash the process; set CXX and LDSHARED to a compiler "
                       "that links the shared libstdc++ (the system g++)")


ext_modules, cmdclass = _extensions()

setup(
    name="megatron-hybrid",
    version="0.1.0",
    description="One copy of an RL actor's weights for Megatron-core training and rollout (3D-HybridEngine)",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # Every subpackage (reshard/, memory/, quant/, kernels/, megatron/ and megatron/patches/, inference/, rl/,
    # convert/), so a new one needs no entry here.
    packages=find_packages(include=["megatron_hybrid", "megatron_hybrid.*"]),
    install_requires=[
        # torch: whatever megatron-core accepts; the README pins the CPU wheel for CPU machines.
        "torch",
        "megatron-core>=0.16.1,<0.20",
        "sentencepiece",
        "transformers",
        "safetensors",
        "tqdm",
        "packaging",
        # megatron-core 0.16.1's dist_checkpointing.save imports psutil without declaring it.
        "psutil",
    ],
    # tensorboard: --tensorboard-dir (torch.utils.tensorboard); the tests read the events back.
    # pyarrow: --prompt-data FILE.parquet (verl's data files); one wheel, no dependencies.
    extras_require={"test": ["pytest", "tensorboard", "pyarrow", "hypothesis"], "tensorboard": ["tensorboard"],
                    "parquet": ["pyarrow"],
                    # gguf + accelerate: tools/fetch_packaged_model.py (transformers reads GGUF files through them).
                    "real-model": ["gguf", "accelerate"],
                    # tools/plot_metrics.py: the accuracy curves of bench/results/.
                    "plot": ["matplotlib"],
                    # mkdocs.yml: the site in docs/ (python -m mkdocs build --strict; tests/test_docs.py builds it),
                    # and tools/make_doc_figures.py, its figures (tests/test_docs.py draws them).
                    "docs": ["mkdocs==1.6.1", "matplotlib"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)

#!/usr/bin/env bash
# Why does an exception thrown inside the native extension end the process on the H200 image? Run on the device
# machine in the repository root; every result goes to $OUT/probe.txt. Variants are built with
# torch.utils.cpp_extension.load (CPU sources only) so each one loads in a fresh process.
set -u
O=${OUT:-/tmp/out}/probe.txt
exec > >(tee -a "$O") 2>&1
echo "== toolchain"; g++ --version | head -1; which g++ c++ cc; python3 -c "import torch,sys; print(torch.__version__, torch._C._GLIBCXX_USE_CXX11_ABI, sys.version)"
TL=$(python3 -c "import torch,os; print(os.path.join(os.path.dirname(torch.__file__),'lib'))")
for f in libc10.so libtorch_cpu.so libtorch_python.so; do echo "$f: $(strings -a $TL/$f | grep -m3 'GCC: (' | sort -u | tr '\n' ' ')"; done
python3 - <<'PY'
import torch.utils.cpp_extension as c, torch
print("cpp_extension cflags:", c._get_pybind11_abi_build_flags() if hasattr(c, "_get_pybind11_abi_build_flags") else "n/a")
print("torch build config:", [l for l in torch.__config__.show().splitlines() if "CXX_FLAGS" in l or "COMPILER" in l][:3])
PY
cat > /tmp/tiny.cpp <<'CPP'
#include <torch/library.h>
#include <ATen/ATen.h>
void always_fails(const at::Tensor& t) { TORCH_CHECK(false, "tiny: expected failure on ", t.sizes()); }
TORCH_LIBRARY(tiny_probe, m) { m.def("fail(Tensor t) -> ()"); }
TORCH_LIBRARY_IMPL(tiny_probe, CPU, m) { m.impl("fail", &always_fails); }
CPP
cat > /tmp/tiny_pybind.cpp <<'CPP'
#include <torch/extension.h>
#include <torch/library.h>
void always_fails(const at::Tensor& t) { TORCH_CHECK(false, "tiny: expected failure on ", t.sizes()); }
TORCH_LIBRARY(tiny_probe, m) { m.def("fail(Tensor t) -> ()"); }
TORCH_LIBRARY_IMPL(tiny_probe, CPU, m) { m.impl("fail", &always_fails); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("direct", &always_fails); }
CPP
probe() {  # probe NAME SOURCE "CFLAGS" "LDFLAGS" [env...]
  local name=$1 src=$2 cflags=$3 ldflags=$4; shift 4
  env "$@" timeout 240 python3 - "$name" "$src" "$cflags" "$ldflags" <<'PY'
import sys, subprocess, os, torch
from torch.utils import cpp_extension as c
name, src, cflags, ldflags = sys.argv[1:5]
d = f"/tmp/probe_{name}"; os.makedirs(d, exist_ok=True)
srcs = src.split(",")
try:
    mod = c.load(name=f"probe_{name}", sources=srcs, extra_cflags=cflags.split(), extra_ldflags=ldflags.split(),
                 build_directory=d, is_python_module=("pybind" in src or "ops.cpp" in src), verbose=False)
except Exception as e:
    print(f"[{name}] BUILD FAILED: {e}"); sys.exit(0)
so = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".so")][0]
ns = "megatron_hybrid" if "ops.cpp" in src else "tiny_probe"
call = ("torch.ops.megatron_hybrid.pack([torch.zeros(5)], torch.zeros(10), [6])" if ns == "megatron_hybrid"
        else "torch.ops.tiny_probe.fail(torch.zeros(2))")
code = f"import torch; torch.ops.load_library({so!r})\ntry:\n    {call}\nexcept RuntimeError as e:\n    print('RuntimeError:', str(e).splitlines()[0])\n"
r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy())
print(f"[{name}] rc={r.returncode} out={r.stdout.strip()[:120]!r} err={r.stderr.strip()[-300:]!r}")
PY
}
if [ "${1:-variants}" = variants ]; then
echo "== variants (CPU sources only)"
probe tiny /tmp/tiny.cpp "-O3" ""
probe tiny_pybind /tmp/tiny_pybind.cpp "-O3" ""
probe ours_O3 csrc/ops.cpp,csrc/copy_plan.cpp "-O3" ""
probe ours_O0g csrc/ops.cpp,csrc/copy_plan.cpp "-O0 -g" ""
probe ours_nostack csrc/ops.cpp,csrc/copy_plan.cpp "-O3" "" TORCH_SHOW_CPP_STACKTRACES=0
probe ours_staticgcc csrc/ops.cpp,csrc/copy_plan.cpp "-O3" "-static-libgcc"
probe ours_nocet csrc/ops.cpp,csrc/copy_plan.cpp "-O3 -fcf-protection=none -fno-stack-clash-protection -U_FORTIFY_SOURCE" ""
probe ours_noasync csrc/ops.cpp,csrc/copy_plan.cpp "-O3 -fasynchronous-unwind-tables -fexceptions" ""
fi
if [ "${1:-variants}" = gdb ]; then
echo "== the real build under cuda-gdb (backtrace of the crash)"
if ls megatron_hybrid/kernels/_C*.so >/dev/null 2>&1; then
  cat > /tmp/crash.py <<'PY'
import torch, megatron_hybrid.kernels.ops as ops
ops.native_ops_available()
try:
    torch.ops.megatron_hybrid.pack([torch.zeros(5)], torch.zeros(10), [6])
except RuntimeError as e:
    print("RuntimeError:", str(e).splitlines()[0])
PY
  python3 /tmp/crash.py; echo "plain rc=$?"
  timeout 120 cuda-gdb -q -batch -ex run -ex bt -ex "info sharedlibrary" --args python3 /tmp/crash.py 2>&1 | grep -v "^\[New Thread\|^\[Thread" | head -80
fi
fi

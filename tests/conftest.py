import os

# Tests run on the CPU; keep each process single-threaded so that 8 ranks share 2 cores sanely.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def triton_interpreter_fixes(monkeypatch) -> None:
    """Work around four defects of Triton 3.5's CPU interpreter (none affects compiled kernels):

    - it turns a loaded scalar (a one-element array) into a loop bound with ``int(array)``, which numpy >= 2.4
      refuses (triton-lang/triton#9171);
    - it multiplies bfloat16 (and float8) tiles in ``tl.dot`` as their bit patterns;
    - it truncates float32 -> bfloat16 casts, where compiled Triton (and PyTorch) round to nearest even;
    - it converts to and from float8 e4m3 otherwise than the GPU (subnormals truncated, bfloat16 from raw bits).
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, *args):
        patch_tensor(tensor, *args)
        # Stays on tl.tensor after the test, like the interpreter's own patches (3.5 never undoes them).
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

    convert_float = interpreter._convert_float

    def as_torch(data, dtype):
        if dtype == tl.float8e4nv:
            return torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)).view(torch.float8_e4m3fn)
        if dtype == tl.bfloat16:
            return torch.from_numpy(np.ascontiguousarray(data).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(data))

    def as_numpy(t, dtype):
        if dtype == tl.float8e4nv:
            return t.view(torch.uint8).numpy()
        if dtype == tl.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()

    torch_dtypes = {tl.float8e4nv: torch.float8_e4m3fn, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16,
                    tl.float32: torch.float32}

    def convert_float_rtne(data, src, dst, rounding):
        if tl.float8e4nv in (src, dst) and src in torch_dtypes and dst in torch_dtypes:
            # float8 e4m3 both ways as PyTorch converts (round to nearest even, subnormals included).
            return as_numpy(as_torch(data, src).to(torch_dtypes[dst]), dst).reshape(data.shape)
        if src == tl.float32 and dst == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(torch.bfloat16)
            return rounded.view(torch.int16).numpy().view(np.uint16).reshape(data.shape)
        return convert_float(data, src, dst, rounding)

    create_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot_bf16(self, a, b, *args):
        def fp32(h):
            if h.dtype == tl.float8e4nv:
                return interpreter.TensorHandle(as_numpy(as_torch(h.data, tl.float8e4nv).float(), tl.float32),
                                                tl.float32)
            if h.dtype != tl.bfloat16:
                return h
            return interpreter.TensorHandle(convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32),
                                            tl.float32)
        return create_dot(self, fp32(a), fp32(b), *args)

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)
    monkeypatch.setattr(interpreter, "_convert_float", convert_float_rtne)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot_bf16)

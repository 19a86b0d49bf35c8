import os

# Tests run on the CPU; keep each process single-threaded so that 8 ranks share 2 cores sanely.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def triton_interpreter_fixes(monkeypatch) -> None:
    """Work around three defects of Triton 3.5's CPU interpreter (none affects compiled kernels):

    - it turns a loaded scalar (a one-element array) into a loop bound with ``int(array)``, which numpy >= 2.4
      refuses (triton-lang/triton#9171);
    - it multiplies bfloat16 tiles in ``tl.dot`` as their uint16 bit patterns;
    - it truncates float32 -> bfloat16 casts, where compiled Triton (and PyTorch) round to nearest even.
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

    def convert_float_rtne(data, src, dst, rounding):
        if src == tl.float32 and dst == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(torch.bfloat16)
            return rounded.view(torch.int16).numpy().view(np.uint16).reshape(data.shape)
        return convert_float(data, src, dst, rounding)

    create_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot_bf16(self, a, b, *args):
        def fp32(h):
            if h.dtype != tl.bfloat16:
                return h
            return interpreter.TensorHandle(convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32),
                                            tl.float32)
        return create_dot(self, fp32(a), fp32(b), *args)

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)
    monkeypatch.setattr(interpreter, "_convert_float", convert_float_rtne)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot_bf16)

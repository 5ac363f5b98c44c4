"""Quick CUDA correctness check of both codecs at large sizes (used before the GPU test suite exists)."""
import torch
from bitsparse import compress, decompress

torch.manual_seed(0)
for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2):
    for n in (1, 4097, (1 << 24) + 12345):
        for sign_pack in (False, True):
            x = torch.randn(n, device="cuda").relu_()
            x[torch.rand(n, device="cuda") < 0.7] = 0
            x = x.to(dtype)
            if n > 100:
                x.view(torch.uint8)[7 * x.element_size() + x.element_size() - 1] |= 0x80  # one negative value
            for enc in ("triton", "torch"):
                c = compress(x, sign_pack=sign_pack, backend=enc)
                for dec in ("triton", "torch"):
                    y = decompress(c, backend=dec)
                    assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), (dtype, n, sign_pack, enc, dec)
            for _ in range(10):
                c = compress(x, sign_pack=sign_pack)
                assert torch.equal(x.view(torch.uint8), decompress(c).view(torch.uint8)), "race?"
print("gpu smoke ok")

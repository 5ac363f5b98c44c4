"""Where does a BitSparse GPT step spend host time? cProfile of steps at T=12000 on CUDA."""
import cProfile, os, pstats, time, statistics
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch, bitsparse
from bitsparse.bench.models import GPT, GPTConfig, shift_to_sparsity
torch.manual_seed(0)
cfg = GPTConfig()
model = GPT(cfg).cuda().to(torch.bfloat16)
tok = torch.randint(cfg.vocab, (1, 12000), device="cuda")
loss_fn = lambda: model(tok, tok)
shift_to_sparsity(model, loss_fn, 0.9)
def step(use):
    if use:
        with bitsparse.compressing():
            loss = loss_fn()
    else:
        loss = loss_fn()
    loss.backward()
for _ in range(4):
    step(False); step(True)
torch.cuda.synchronize()
for use in (False, True):
    cpu = []
    for _ in range(5):
        torch.cuda.synchronize(); t0 = time.perf_counter(); step(use); cpu.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    print("bitsparse" if use else "dense", "host ms per step", 1000 * statistics.median(cpu))
pr = cProfile.Profile()
pr.enable()
for _ in range(5):
    step(True)
torch.cuda.synchronize()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)

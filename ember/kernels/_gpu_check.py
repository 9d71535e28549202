# Temporary: GPU sanity/bench script, deleted after the device run.
import torch, triton, time
import torch.nn.functional as F
from ember.kernels import *
from ember.kernels.decode_attention import choose_num_splits
print("torch", torch.__version__, "triton", triton.__version__, "interp knob", triton.knobs.runtime.interpret)
dev = "cuda"
def bench(fn, n=50):
    return triton.testing.do_bench(fn, warmup=10, rep=n)

def setup(B, ctx, Hq=32, Hk=8, D=128, bs=16, dtype=torch.bfloat16):
    nblk = B * ((ctx + bs - 1) // bs) + 1
    kc = torch.randn(nblk, bs, Hk, D, device=dev, dtype=dtype)
    vc = torch.randn_like(kc)
    bt = torch.randperm(nblk - 1, device=dev).add(1).int()[: B * ((ctx + bs - 1) // bs)].view(B, -1)
    return kc, vc, bt

# CUDA graph capture of decode with splits
B, ctx = 8, 3000
kc, vc, bt = setup(B, ctx)
q = torch.randn(B, 32, 128, device=dev, dtype=torch.bfloat16)
lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
out = torch.empty_like(q)
for ns in (1, 4):
    paged_decode_attention(q, kc, vc, bt, lens, 0.088, out=out, num_splits=ns)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        paged_decode_attention(q, kc, vc, bt, lens, 0.088, out=out, num_splits=ns)
    lens.fill_(1234); q.normal_()
    g.replay(); torch.cuda.synchronize()
    ref = paged_decode_attention_ref(q.float(), kc.float(), vc.float(), bt, lens, 0.088)
    print("graph replay splits", ns, "maxerr", (out.float() - ref).abs().max().item())
    lens.fill_(ctx)

for B, ctx in [(64, 4096), (8, 4096), (1, 32768), (256, 1024)]:
    kc, vc, bt = setup(B, ctx)
    q = torch.randn(B, 32, 128, device=dev, dtype=torch.bfloat16)
    lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    gb = 2 * kc[bt.long()].numel() * 2 / 1e9
    for ns in (None, 1):
        ms = bench(lambda: paged_decode_attention(q, kc, vc, bt, lens, 0.088, num_splits=ns, max_seq_len=ctx))
        print(f"decode B={B} ctx={ctx} splits={ns or choose_num_splits(B, 8, ctx, 132)}: {ms*1e3:.1f} us, {gb/ms:.2f} TB/s")

for B, L in [(4, 2048), (1, 8192)]:
    kc, vc, bt = setup(B, L)
    q = torch.randn(B * L, 32, 128, device=dev, dtype=torch.bfloat16)
    lens = torch.full((B,), L, device=dev, dtype=torch.int32)
    qsl = torch.arange(B + 1, device=dev, dtype=torch.int32) * L
    ms = bench(lambda: paged_prefill_attention(q, kc, vc, bt, lens, qsl, L, 0.088))
    flops = B * 4 * 32 * 128 * L * L / 2
    qs = q.view(B, L, 32, 128).transpose(1, 2).contiguous()
    ks = torch.randn(B, 8, L, 128, device=dev, dtype=torch.bfloat16)
    ms_sdpa = bench(lambda: F.scaled_dot_product_attention(qs, ks, ks, is_causal=True, enable_gqa=True))
    print(f"prefill B={B} L={L}: {ms*1e3:.0f} us {flops/ms/1e9:.0f} TFLOP/s; sdpa {ms_sdpa*1e3:.0f} us {flops/ms_sdpa/1e9:.0f}")
# chunked prefill: 16 chunks of 64 over 4000 prefix
B, c, n = 16, 4000, 64
kc, vc, bt = setup(B, c + n)
q = torch.randn(B * n, 32, 128, device=dev, dtype=torch.bfloat16)
lens = torch.full((B,), c + n, device=dev, dtype=torch.int32)
qsl = torch.arange(B + 1, device=dev, dtype=torch.int32) * n
ms = bench(lambda: paged_prefill_attention(q, kc, vc, bt, lens, qsl, n, 0.088))
gb = 2 * B * (c + n) * 8 * 128 * 2 / 1e9
print(f"chunked prefill 16x64 over 4000: {ms*1e3:.0f} us {gb/ms:.2f} TB/s")
x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16); r = torch.randn_like(x); w = torch.ones(4096, device=dev, dtype=torch.bfloat16)
ms = bench(lambda: fused_add_rms_norm(x, r, w, 1e-6)); print(f"fused_add_rms_norm 4096x4096: {ms*1e3:.0f} us {4*x.numel()*2/ms/1e9:.2f} TB/s")

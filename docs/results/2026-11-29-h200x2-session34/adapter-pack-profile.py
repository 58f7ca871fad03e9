import time, torch, asyncio
from asyncroll.adapters import AdapterPlans
from asyncroll.update_check import nonfinite
mods = {"q_proj":(3584,3584),"k_proj":(512,3584),"v_proj":(512,3584),"o_proj":(3584,3584),"gate_proj":(18944,3584),"up_proj":(18944,3584),"down_proj":(3584,18944)}
r=64; t={}
for l in range(28):
    for m,(o,i) in mods.items():
        a="self_attn" if m[0] in "qkvo" else "mlp"
        t[f"base_model.model.model.layers.{l}.{a}.{m}.lora_A.weight"]=torch.randn(r,i,device="cuda",dtype=torch.bfloat16)
        t[f"base_model.model.model.layers.{l}.{a}.{m}.lora_B.weight"]=torch.randn(o,r,device="cuda",dtype=torch.bfloat16)
plans=AdapterPlans()
def tm(label,f,n=30):
    f(); torch.cuda.synchronize(); s=time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize(); print(f"{label}: {(time.perf_counter()-s)/n*1e3:.3f} ms", flush=True)
tm("plan hit", lambda: plans.plan(t))
plan,values=plans.plan(t)
tm("pack (sync)", lambda: plan.pack(values))
p=plan.pack(values)
tm("nonfinite", lambda: nonfinite(p.chunks))
tm("pack_finite", lambda: plan.pack_finite(values))
flats=[v.reshape(-1) for v in values]
tm("cat alone", lambda: torch.cat(flats))
out=torch.empty(sum(f.numel() for f in flats),dtype=torch.bfloat16,device="cuda")
tm("cat out=", lambda: torch.cat(flats,out=out))
views=list(out.split([f.numel() for f in flats]))
tm("foreach copy into kept views", lambda: torch._foreach_copy_(views, flats))
x=p.chunks["asyncroll.adapter.bfloat16"]
tm("isfinite all", lambda: bool(torch.isfinite(x).all()))
tm("amax abs item", lambda: x.abs().amax().item())
async def hop():
    s=time.perf_counter()
    for _ in range(30): await asyncio.to_thread(lambda: None)
    print(f"to_thread hop: {(time.perf_counter()-s)/30*1e3:.3f} ms")
    s=time.perf_counter()
    for _ in range(30): await asyncio.to_thread(plan.pack_finite, values)
    print(f"to_thread pack_finite: {(time.perf_counter()-s)/30*1e3:.3f} ms")
asyncio.run(hop())

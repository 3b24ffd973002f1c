"""Draft offload/reload through accelerate hooks: memory reclaimed, latencies, dispatch overhead.

    python eval/bench_offload.py --out results/bench_offload            # on a CUDA GPU
    python eval/bench_offload.py --device cpu --out results/bench_offload  # latencies only

Random-weight Llama models of realistic size (default: a ~1.1B target, 2048 wide x 22 layers,
and a ~160M draft, 768 x 12; bf16 on CUDA; on CPU only the draft is built). Measured:
  - bytes reclaimed by an offload (allocator stats before/after) against the draft's size;
  - offload latency (first: makes the pinned host copy; later: drops device tensors) and reload
    latency (time the caller is blocked starting the side-stream copy, and until it has landed);
  - dispatch overhead on the decoding path: a one-token draft forward with and without the
    residency hook, and `DraftOffload.step` (memory probe + state machine) per step;
  - (CUDA) the largest batch whose prefill of --context tokens fits under a memory cap
    (--cap-gib, by trial) with the draft resident and with it offloaded.
Writes <out>.json and <out>.md, stamped with commit, versions and machine.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_specdec
from hf_specdec.offload import attach_residency_hook, detach_residency_hook
from hf_specdec.policies import StepContext
from bench_hierarchy import forward_seconds  # eval/ is on sys.path when run as a script
from report import write_results


def llama(hidden, layers, vocab, dtype, device):
    config = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 2.75), num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                         vocab_size=vocab, max_position_embeddings=8192)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype).eval()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def largest_batch(target, device, context, upper=4096):
    """Largest batch whose prefill of `context` tokens (logits of the last one) fits, by bisection."""
    def fits(b):
        try:
            cache = hf_specdec._compat.new_cache(target)
            ids = torch.zeros(b, context, dtype=torch.long, device=device)
            target(input_ids=ids, use_cache=True, logits_to_keep=1,
                   **hf_specdec._compat.cache_kwargs(target, cache))
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            cache = ids = None
            torch.cuda.empty_cache()
    lo, hi = 0, 1
    while hi <= upper and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--target", default="2048x22", help="hidden x layers")
    parser.add_argument("--draft", default="768x12", help="hidden x layers")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--context", type=int, default=1024, help="tokens per row for the largest-batch search")
    parser.add_argument("--cap-gib", type=float, default=8.0, help="memory cap for the largest-batch search")
    parser.add_argument("--out", default="results/bench_offload")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:        # memory calls want the index
        device = torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    draft = llama(*map(int, args.draft.split("x")), args.vocab, dtype, device)
    res = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "args": vars(args),
           "draft_params": sum(p.numel() for p in draft.parameters())}

    plain_s = forward_seconds(draft, 1, args.repeats)
    hook = attach_residency_hook(draft)
    res["draft_bytes"] = hook.nbytes
    res["forward_s"] = {"draft_plain": plain_s, "draft_hooked": forward_seconds(draft, 1, args.repeats)}
    # the hook's own cost, isolated from the forward's noise: pre_forward of a resident draft
    n = 10000
    t = time.perf_counter()
    for _ in range(n):
        hook.pre_forward(draft)
    res["hook_pre_forward_us"] = (time.perf_counter() - t) / n * 1e6

    allocated = torch.cuda.memory_allocated(device) if cuda else None
    sync(device)
    t = time.perf_counter()
    hook.offload()
    sync(device)
    res["offload_first_s"] = time.perf_counter() - t            # includes making the host copy
    if cuda:
        res["bytes_reclaimed"] = allocated - torch.cuda.memory_allocated(device)
        res["host_copy_pinned"] = all(h.is_pinned() for h in hook.host.values())
    reload_blocked, reload_total, offload_again = [], [], []
    for _ in range(5):
        t = time.perf_counter()
        hook.start_reload()
        reload_blocked.append(time.perf_counter() - t)
        while not hook.poll():
            pass
        reload_total.append(time.perf_counter() - t)
        sync(device)
        t = time.perf_counter()
        hook.offload()
        sync(device)
        offload_again.append(time.perf_counter() - t)
    res.update(reload_blocked_s=statistics.median(reload_blocked), reload_total_s=statistics.median(reload_total),
               offload_s=statistics.median(offload_again))
    if cuda:
        res["reload_gb_per_s"] = hook.nbytes / res["reload_total_s"] / 1e9

    # the manager's per-step cost while resident (probe + state machine), default CUDA probe on GPU
    hook.reload(wait=True)
    manager = hf_specdec.DraftOffload(probe=None if cuda else (lambda: 1 << 40), persist_steps=10 ** 9)
    manager.begin([hf_specdec.ModelDrafter(draft)], None)
    ctx = StepContext(0, 8, 1)
    t = time.perf_counter()
    for _ in range(1000):
        manager.step(ctx, 0)
    res["manager_step_us"] = (time.perf_counter() - t) / 1000 * 1e6
    manager.disable()

    if cuda:     # the target only matters for the memory it can use
        target = llama(*map(int, args.target.split("x")), args.vocab, dtype, device)
        res["target_params"] = sum(p.numel() for p in target.parameters())
        cap = args.cap_gib * 2 ** 30
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
        hook = attach_residency_hook(draft)
        res["largest_batch_draft_resident"] = largest_batch(target, device, args.context)
        hook.offload()
        res["largest_batch_draft_offloaded"] = largest_batch(target, device, args.context)
        detach_residency_hook(draft)
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    else:
        detach_residency_hook(draft)

    out = Path(args.out)
    print(write_results(out.parent, out.name, res, markdown(res)).read_text())


def markdown(r) -> str:
    mib = lambda b: f"{b / 2**20:.1f} MiB"   # noqa: E731
    rows = [("device", r["device"]),
            ("target / draft parameters", f"{r['target_params'] / 1e6:.0f}M / {r['draft_params'] / 1e6:.0f}M"
             if "target_params" in r else f"(not built) / {r['draft_params'] / 1e6:.0f}M"),
            ("draft bytes on device", mib(r["draft_bytes"])),
            ("bytes reclaimed by offload", mib(r["bytes_reclaimed"]) if "bytes_reclaimed" in r else "n/a (CPU)"),
            ("offload, first (host copy made)", f"{r['offload_first_s'] * 1e3:.1f} ms"),
            ("offload, later", f"{r['offload_s'] * 1e3:.2f} ms"),
            ("reload: caller blocked", f"{r['reload_blocked_s'] * 1e3:.2f} ms"),
            ("reload: until landed", f"{r['reload_total_s'] * 1e3:.1f} ms"
             + (f" ({r['reload_gb_per_s']:.1f} GB/s)" if "reload_gb_per_s" in r else "")),
            ("draft decode forward, no hook / hooked",
             f"{r['forward_s']['draft_plain'] * 1e3:.2f} / {r['forward_s']['draft_hooked'] * 1e3:.2f} ms"),
            ("hook pre_forward (resident)", f"{r['hook_pre_forward_us']:.2f} µs"),
            ("DraftOffload.step (probe + state)", f"{r['manager_step_us']:.1f} µs")]
    if "largest_batch_draft_resident" in r:
        rows.append((f"largest batch, {r['args']['context']} tokens, {r['args']['cap_gib']} GiB cap: "
                     "draft resident / offloaded",
                     f"{r['largest_batch_draft_resident']} / {r['largest_batch_draft_offloaded']}"))
    return "# Draft offload\n\n| measure | value |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in rows) + "\n"


if __name__ == "__main__":
    main()

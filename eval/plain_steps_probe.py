"""Probe: our plain steps (k = 0) on the compiled static path against Transformers' compiled plain
generate(), with and without a device sync after each step's read, and a profile of each.

    python eval/plain_steps_probe.py 0.5b toy     # target and draft sizes (hf_specdec.testing.QWEN2_SIZES)

Written for a lent GPU, where the static path compiles and records CUDA graphs (on a CPU it
compiles with dynamo's eager backend: the same graphs and guards, no speed). It prints ms per
token, the minimum of 3 calls of 64 tokens at batch 1, for Transformers' compiled plain, ours at
fixed k = 4, ours with every step plain, and "auto"; then two profiles.
"""
import logging
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import hf_specdec
from hf_specdec import loop
from hf_specdec.policies import SpecPolicy
from hf_specdec.policies.length import LengthPolicy
from hf_specdec.testing import QWEN2_VOCAB, circle_model


class NoDrafts(LengthPolicy):
    """k = 0 on every step: every step is a plain one."""

    def choose(self, ctx) -> int:
        return 0


def main(target_size: str, draft_size: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch._logging.set_logs(perf_hints=True)
    cuda = torch.cuda.is_available()
    device, dtype, vocab = ("cuda", torch.bfloat16, QWEN2_VOCAB) if cuda else ("cpu", torch.float32, 512)
    target = circle_model(target_size, vocab=vocab, device=device, dtype=dtype)
    draft = circle_model(draft_size, vocab=vocab, alpha=0.8, seed=1, device=device, dtype=dtype)
    ids = torch.randint(0, vocab, (1, 32), device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                  cache_implementation="static")
    if not cuda:
        from transformers import CompileConfig
        kwargs["compile_config"] = config = CompileConfig(fullgraph=True, backend="eager")
        config._compile_all_devices = True
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def ours(policy):
        return lambda: target.generate(ids, custom_generate=hf_specdec.generate, assistant_models=[draft],
                                       spec_policy=policy, **kwargs)
    methods = {"transformers plain/static": lambda: type(target).generate(target, ids, **kwargs),
               "fixed:4": ours("fixed:4"), "every step plain": ours(SpecPolicy(length=NoDrafts())),
               "auto": ours("auto")}
    read = loop.DecodingLoop.read

    def read_then_sync(self, *args):
        outcome = read(self, *args)
        sync()
        return outcome
    for name, run in methods.items():
        start = time.perf_counter()
        run()
        sync()
        logging.info("%s first call %.1f s", name, time.perf_counter() - start)
    for synced in (False, True):
        loop.DecodingLoop.read = read_then_sync if synced else read
        for name, run in methods.items():
            times = []
            for _ in range(3):
                sync()
                start = time.perf_counter()
                run()
                sync()
                times.append(time.perf_counter() - start)
            logging.info("%s, a sync after each read %s: %.1f ms/token", name, synced, min(times) / 64 * 1e3)
    loop.DecodingLoop.read = read
    for name in ("every step plain", "transformers plain/static"):
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            methods[name]()
            sync()
        print(f"== profile: {name}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main(*sys.argv[1:3])

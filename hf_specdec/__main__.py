"""Command line.

`python -m hf_specdec serve MODEL --draft DRAFT [transformers serve flags]` serves MODEL with
Transformers' OpenAI-compatible server, its continuous batching speculating with DRAFT (`serve.py`):

    python -m hf_specdec serve Qwen/Qwen2.5-Coder-1.5B-Instruct --draft Qwen/Qwen2.5-Coder-0.5B-Instruct --port 8000
    python -m hf_specdec serve <hub id or path> --prompt-lookup-num-tokens 3

`python -m hf_specdec profile ...` measures a latency profile for length policies.

    python -m hf_specdec profile --target smollm2 --drafter bf16 --out profile.json
    python -m hf_specdec profile --target <hub id or path> --drafter <hub id or path> --out profile.json

The JSON loads with `hf_specdec.CostProfile.load(path)` and feeds `AdaSpec(cost_model=...)`,
`DSDGoodput(cost_model=...)` and `Nightjar(switch_cost=...)`.
"""
from __future__ import annotations

import argparse
import logging
import sys

logger = logging.getLogger("hf_specdec")


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _load(args):
    from transformers import AutoModelForCausalLM
    from .drafters import self_draft
    if args.target == "smollm2":
        from .embedded import load_smollm2
        target, _ = load_smollm2()
    else:
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype="auto").eval()
    if args.drafter in ("bf16", "fp16", "int8"):
        draft = self_draft(target, args.drafter).model
    else:
        draft = AutoModelForCausalLM.from_pretrained(args.drafter, dtype="auto").eval()
    return target, draft


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_specdec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    prof = sub.add_parser("profile", help="measure forward times, fit the latency models, save JSON")
    prof.add_argument("--target", default="smollm2", help="'smollm2' (embedded) or a hub id / path")
    prof.add_argument("--drafter", default="bf16", help="bf16 | fp16 | int8 (a copy of the target) or a hub id / path")
    prof.add_argument("--batch-sizes", type=_ints, default=[1, 2, 4, 8, 16])
    prof.add_argument("--widths", type=_ints, default=[1, 3, 5, 8], help="tokens per row in one forward")
    prof.add_argument("--contexts", type=_ints, default=[32, 128, 256])
    prof.add_argument("--lags", type=_ints, default=[1, 4, 16, 64], help="catch-up lengths for C(L, B)")
    prof.add_argument("--repeats", type=int, default=3)
    prof.add_argument("--out", required=True)
    from . import serve
    serve.add_arguments(sub.add_parser("serve", help="Transformers' OpenAI-compatible server, speculating; flags "
                                       "not listed here go to `transformers serve`"))
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    if args.command == "serve":
        serve.run(args, rest)
        return 0
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    from .costmodel import profile
    target, draft = _load(args)
    result = profile(target, draft, args.batch_sizes, args.widths, args.contexts, args.lags, args.repeats)
    result.save(args.out)
    logger.info("target: %s\ndraft: %s\nwrote %s", result.target, result.draft, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m hf_specdec serve MODEL --draft DRAFT`: Transformers' own OpenAI-compatible server
(`transformers serve MODEL --continuous-batching`), whose continuous batching speculates.

The server is Transformers': its endpoints, request handling, errors and flags (every flag that is
not ours goes to `transformers serve` as it is). Ours: once the server has loaded MODEL (on
Transformers 5.25 in the model's own engine process), it loads DRAFT the same way (device, dtype,
quantization), `enable`s MODEL, and each continuous batching manager the server makes for MODEL
speculates with DRAFT (or prompt lookup), the policy deciding each step's draft length from the
batch (`continuous_batching.py`). What reaches the engine is `speculate` and its keyword
arguments, plain data (`_compat.serving.serve_loads`). A request that would fail
Transformers' generation loop, and with it the server (a prompt longer than the paged cache, a chat
completion without messages), is answered with a 400 before it gets there.
"""
from __future__ import annotations

import argparse
import functools
import logging

from . import continuous_batching
from ._compat import serving
from .enable import enable

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="the model to serve: a hub id or path (`repo:file.gguf` for GGUF weights)")
    drafter = parser.add_mutually_exclusive_group(required=True)
    drafter.add_argument("--draft", help="the draft model, loaded as the server loads MODEL")
    drafter.add_argument("--prompt-lookup-num-tokens", type=int, help="draft by prompt lookup, this many tokens")
    parser.add_argument("--max-matching-ngram-size", type=int, help="prompt lookup's longest n-gram (default 2)")
    parser.add_argument("--spec-policy", help="the draft length policy: 'auto' for a draft (default), 'nightjar', "
                        "'fixed:k', ...; prompt lookup drafts --prompt-lookup-num-tokens by default")


def run(args: argparse.Namespace, transformers_args: list[str]) -> None:
    """Serve until stopped; `transformers_args` go to `transformers serve`."""
    refused = [flag for flag in ("--no-continuous-batching", "--compile", "--cb-use-cuda-graph")
               if flag in transformers_args]
    if refused:
        raise ValueError(f"{', '.join(refused)}: speculation runs in the server's continuous batching, synchronous, "
                         "without CUDA graphs or compilation")
    if "--continuous-batching" not in transformers_args:
        transformers_args = ["--continuous-batching", *transformers_args]
    hook = functools.partial(speculate, draft=args.draft, prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
                             max_matching_ngram_size=args.max_matching_ngram_size, spec_policy=args.spec_policy)
    with serving.serve_loads(hook), serving.serve_refusals(check_chat, continuous_batching.RequestRefused):
        serving.transformers_cli(["serve", args.model, *transformers_args])


def check_chat(body: dict) -> None:
    """A chat completion needs messages (Transformers' server fails on a body without, with a 500)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise continuous_batching.RequestRefused("messages must be a non-empty list of messages, got "
                                                 f"{messages!r}"[:200])


def speculate(model, load, *, draft: str | None = None, prompt_lookup_num_tokens: int | None = None,
              max_matching_ngram_size: int | None = None, spec_policy=None):
    """`enable(model)`, and make each continuous batching manager of it speculate with `draft`
    (loaded by `load(draft)`) or prompt lookup, under `spec_policy`. The arguments are checked here,
    before the server takes a request. Returns `model`."""
    options = {"assistant_model": load(draft) if draft is not None else None,
               "prompt_lookup_num_tokens": prompt_lookup_num_tokens,
               "max_matching_ngram_size": max_matching_ngram_size, "spec_policy": spec_policy}
    speculation = continuous_batching.speculation_from(model, model.generation_config, **options)
    if speculation is None:
        raise ValueError("serve needs a drafter: --draft or --prompt-lookup-num-tokens")
    enable(model)
    model.init_continuous_batching = functools.partial(model.init_continuous_batching, **options)
    logger.info("serving %s with speculation: %s, policy %r", type(model).__name__,
                f"draft {draft}" if draft is not None else f"prompt lookup of {prompt_lookup_num_tokens} tokens",
                speculation.policy.length)
    return model

"""Decoding methods by name, for the evaluation scripts: `plain` or `<policy>[:k]@<drafter>`,
either followed by `/static` for `cache_implementation="static"` (Transformers: preallocated caches
and a compiled forward on an accelerator; ours: preallocated caches).

    methods = parse_methods("plain,plain/static,hf-assisted:5@draft,fixed:5@draft,auto@draft,hedgespec@pool")
    factory = MethodFactory(target, draft_model=draft, pool=("draft", "pld"))
    harness.generate(model, factory, methods[2], **inputs)     # Transformers' own path for plain, hf-assisted

policy      hf-assisted[:k]  Transformers' own assisted generation (its code, not ours): k drafts a
                           step, constant schedule, no confidence stop (default k 5); @draft or @pld;
                           batch 1 only (Transformers refuses larger batches)
            the library's own names (hf_specdec.policies.resolve_policy): auto (the default),
                           fixed[:k], measured[:k], nightjar[:k], adaspec[:k], dsd[:k], hf-heuristic[:k],
                           confidence; hedgespec, ucb, exp3 choose among the drafters of @pool
            ablations (SELECTOR_ABLATIONS, LENGTH_ABLATIONS): nightjar-exact (the paper's one bandit per batch size), HedgeSpec
                           variants (hedgespec-cold, -hedge, -adanormalhedge, -cost, -every2, -every4,
                           -cost-every4, -cost-every8);
                           a selector's ':k' is k drafts every step (the library's: 4)
drafter     draft          the draft model (an embedded name, a hub id or a path)
            pld            prompt lookup
            bf16, fp16, int8   a copy of the target (hf_specdec.self_draft)
            hier           three models: prompt lookup -> draft model -> target (2 drafts per inner
                           cycle, 2 cycles); without a draft model, the target's int8 -> bf16 copies
            pool           the drafters named by `pool` (for the selectors)
            a script's own drafters and pools by name (MethodFactory's `drafters`, `pools`)

AdaSpec and DSD measure a cost profile of target and drafter the first time they meet them
(hf_specdec.costmodel.cached_profile: cached on disk, so a resumed run reuses it). Drafters and
policies are built once and live for the whole run: the learning policies carry what they learned
from one call to the next, as they would in a server.
"""
from __future__ import annotations

from dataclasses import dataclass

import hf_specdec
from hf_specdec.policies import NAMES, resolve_policy

HF_ASSISTED = "hf-assisted"
SELECTOR_NAMES = ("hedgespec", "ucb", "exp3")
# what the library has no name for: name -> selector, or length policy (given a cost profile or None)
SELECTOR_ABLATIONS = {
    "hedgespec-cold": lambda: hf_specdec.HedgeSpec(prompt_positions=0),      # the paper's cold start
    "hedgespec-hedge": lambda: hf_specdec.HedgeSpec(learner="hedge"),
    "hedgespec-adanormalhedge": lambda: hf_specdec.HedgeSpec(learner="adanormalhedge"),
    "hedgespec-cost": lambda: hf_specdec.HedgeSpec(cost_aware=True),
    "hedgespec-every2": lambda: hf_specdec.HedgeSpec(feedback_every=2),
    "hedgespec-every4": lambda: hf_specdec.HedgeSpec(feedback_every=4),
    "hedgespec-cost-every4": lambda: hf_specdec.HedgeSpec(cost_aware=True, feedback_every=4),
    "hedgespec-cost-every8": lambda: hf_specdec.HedgeSpec(cost_aware=True, feedback_every=8)}
LENGTH_ABLATIONS = {"nightjar-exact": lambda profile, **kw: hf_specdec.Nightjar(switch_cost=profile, buckets="exact", **kw)}
# the length policies that model costs, given the pair's CostProfile (the simulator: none to measure)
PROFILED = {"adaspec": lambda profile, **kw: hf_specdec.AdaSpec(profile, **kw),
            "dsd": lambda profile, **kw: hf_specdec.DSDGoodput(profile, **kw),
            "nightjar": lambda profile, **kw: hf_specdec.Nightjar(switch_cost=profile, **kw), **LENGTH_ABLATIONS}
SELECTORS = SELECTOR_NAMES + tuple(SELECTOR_ABLATIONS)
LENGTH_POLICIES = tuple(n for n in NAMES if n not in SELECTOR_NAMES) + tuple(LENGTH_ABLATIONS)
# draft-vocab: the env's own (eval/envs.py: the draft over its most frequent tokens)
DRAFTERS = ("draft", "pld", "bf16", "fp16", "int8", "hier", "pool", "draft-vocab")
POOL_MEMBERS = ("draft", "pld", "bf16", "fp16", "int8")
TAKES_K = (HF_ASSISTED, "fixed", "measured", "nightjar", "adaspec", "dsd", "hf-heuristic", "nightjar-exact",
           *SELECTORS)
STATIC = "/static"
USAGE = (f"plain or <policy>[:k]@<drafter> with policy one of {', '.join((HF_ASSISTED,) + LENGTH_POLICIES + SELECTORS)} "
         f"(':k' for {', '.join(TAKES_K)}) and drafter one of {', '.join(DRAFTERS)}; "
         f"{', '.join(SELECTORS)} take @pool, {HF_ASSISTED} @draft, @draft-vocab or @pld, the others a single drafter; "
         f"'{STATIC}' after any of them sets cache_implementation='static'")


@dataclass(frozen=True)
class Method:
    name: str                   # as given
    policy: str | None = None   # None: plain generate()
    drafter: str | None = None
    k: int | None = None        # drafts a step (fixed, selectors) or the longest draft; None: the default
    static: bool = False        # cache_implementation="static": Transformers compiles the target's forward

    @property
    def ours(self) -> bool:
        """Runs hf_specdec's loop (else Transformers' own generate())."""
        return self.policy not in (None, HF_ASSISTED)


def parse_method(name: str) -> Method:
    base = name.removesuffix(STATIC)
    static = base != name
    if base == "plain":
        return Method(name, static=static)
    head, at, drafter = base.partition("@")
    policy, colon, k = head.partition(":")
    if not at or policy not in (HF_ASSISTED,) + LENGTH_POLICIES + SELECTORS or drafter not in DRAFTERS:
        raise ValueError(f"unknown method {name!r}; use {USAGE}")
    if policy == HF_ASSISTED and drafter not in ("draft", "draft-vocab", "pld"):
        raise ValueError(f"method {name!r}: {HF_ASSISTED} runs Transformers' assisted generation with @draft, "
                         "@draft-vocab or @pld")
    if colon and (policy not in TAKES_K or not k.isdigit() or int(k) < (policy != "fixed")):
        raise ValueError(f"method {name!r}: ':k' takes an integer >= 1 (fixed: >= 0, our loop without drafts), "
                         f"for {', '.join(TAKES_K)} only")
    if (policy in SELECTORS) != (drafter == "pool"):
        raise ValueError(f"method {name!r}: {', '.join(SELECTORS)} choose among the drafters of @pool, "
                         "and only they take @pool")
    return Method(name, policy, drafter, int(k) if colon else None, static)


def parse_methods(text: str, first: str | None = None) -> list[Method]:
    """A comma-separated list of method names -> Methods; ValueError listing what exists, or where
    the list does not start with `first` (a benchmark's reference, e.g. plain)."""
    methods = [parse_method(m.strip()) for m in text.split(",") if m.strip()]
    if not methods:
        raise ValueError(f"no method given; use {USAGE}")
    if len({m.name for m in methods}) != len(methods):
        raise ValueError("a method is listed twice")
    if first is not None and methods[0].name != first:
        raise ValueError(f"--methods must start with {first} (the reference)")
    return methods


def parse_pool(text: str) -> tuple[str, ...]:
    pool = tuple(p.strip() for p in text.split(",") if p.strip())
    if len(pool) < 2 or len(set(pool)) != len(pool) or any(p not in POOL_MEMBERS for p in pool):
        raise ValueError(f"--pool must name at least two different drafters among {', '.join(POOL_MEMBERS)}, "
                         f"got {text!r}")
    return pool


class MethodFactory:
    """Builds the drafters and policies of methods, once each. draft_model: the causal LM of the
    `draft` drafter (None: methods using it are refused); pool: the drafters of @pool; drafters:
    more drafters by name (a script's own, e.g. datastores); pools: more pools by name (@<name>)."""

    def __init__(self, target, draft_model=None, pool=("draft", "pld"), drafters: dict | None = None,
                 pools: dict | None = None):
        self.target, self.draft_model = target, draft_model
        self.pools = {"pool": tuple(pool), **(pools or {})}
        self._drafters, self._policies = dict(drafters or {}), {}

    def drafter(self, kind: str):
        if kind not in self._drafters:
            self._drafters[kind] = self._make_drafter(kind)
        return self._drafters[kind]

    def _make_drafter(self, kind: str):
        if kind == "pld":
            return hf_specdec.PromptLookupDrafter()
        if kind in ("bf16", "fp16", "int8"):
            return hf_specdec.self_draft(self.target, kind)
        if kind == "hier" and self.draft_model is None:
            return hf_specdec.HierarchicalDrafter(hf_specdec.self_draft(self.target, "int8"),
                                                  hf_specdec.self_draft(self.target, "bf16"), draft_len=3, cycles=2)
        if kind == "draft-vocab":
            raise ValueError("drafter 'draft-vocab' is the qwen-coder-cpu env's (eval/envs.py)")
        if self.draft_model is None:
            raise ValueError(f"drafter {kind!r} needs a draft model (--draft)")
        model = hf_specdec.ModelDrafter(self.draft_model, name="draft")
        if kind == "hier":
            return hf_specdec.HierarchicalDrafter(hf_specdec.PromptLookupDrafter(), model, draft_len=2, cycles=2)
        return model

    def _hf_assisted(self, method: Method) -> dict:
        """Transformers' assisted generation with a constant k and no confidence-based early stop;
        it reads those settings from the assistant's own generation config."""
        k = method.k or 5
        if method.drafter == "pld":
            return {"prompt_lookup_num_tokens": k}
        named = self._drafters.get(method.drafter)       # a named model drafter's model (e.g. @draft-vocab)
        assistant = named.model if isinstance(named, hf_specdec.ModelDrafter) else self.draft_model
        if assistant is None:
            raise ValueError(f"method {method.name!r} needs a draft model (--draft)")
        config = assistant.generation_config
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
        config.assistant_confidence_threshold = 0.0
        return {"assistant_model": assistant}

    def policy(self, method: Method):
        if method.name not in self._policies:
            self._policies[method.name] = self._make_policy(method)
        return self._policies[method.name]

    def _make_policy(self, m: Method):
        return spec_policy(m.policy, m.k)

    def generate_kwargs(self, method: Method) -> dict:
        """The extra generate() arguments of `method` (plain: none; see `harness.generate` for
        which generate() takes them)."""
        static = {"cache_implementation": "static"} if method.static else {}
        if method.policy is None:
            return static
        if method.policy == HF_ASSISTED:
            return {**static, **self._hf_assisted(method)}
        kinds = self.pools.get(method.drafter, (method.drafter,))
        return {**static, "assistant_models": [self.drafter(kind) for kind in kinds], "spec_policy": self.policy(method)}


def spec_policy(policy: str, k: int | None = None, profile=None):
    """What `spec_policy` takes for a policy name: the library's own (`resolve_policy`, `k` as its
    ':k'; "auto" as is, resolved by the loop for its number of drafters) or an ablation. A selector
    with `k` drafts k tokens every step. profile: the pair's CostProfile, for the policies that
    model costs where none can be measured (the simulator)."""
    if policy in SELECTORS:
        selector = SELECTOR_ABLATIONS[policy]() if policy in SELECTOR_ABLATIONS else resolve_policy(policy).selector
        return hf_specdec.SpecPolicy(selector=selector, length=hf_specdec.FixedLength(4 if k is None else k))
    if policy in PROFILED and (profile is not None or policy in LENGTH_ABLATIONS):
        return PROFILED[policy](profile, **({} if k is None else {"max_len": k}))
    if policy == "auto":
        return "auto"
    return resolve_policy(policy if k is None else f"{policy}:{k}")

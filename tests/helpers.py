import hf_specdec
from hf_specdec.policies import LengthPolicy


def spec(model, drafters, policy="fixed:4", **kwargs):
    """model.generate through the custom_generate hook (no enable needed)."""
    return model.generate(custom_generate=hf_specdec.generate, assistant_models=drafters,
                          spec_policy=policy, **kwargs)


def assert_same(a, b):
    assert a.shape == b.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    bad = (a != b).any(1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad} differ:\n{a[bad]}\n{b[bad]}"


class Scripted(LengthPolicy):
    """k = ks(step) for the step-th step of each generate() call."""

    def __init__(self, ks):
        self.ks, self.contexts = ks, []       # every StepContext seen

    def choose(self, ctx):
        self.contexts.append(ctx)
        return self.ks(ctx.step)


def step_record(batch_size, drafters, k, proposed, accepted, emitted, draft_s=0.0, verify_s=0.0, rows=None,
                drafter_s=None, gammas=None, **kw):
    """A StepRecord from the positional shorthand the policy tests use."""
    from hf_specdec.stats import StepRecord
    return StepRecord(batch_size=batch_size, drafters=drafters, k=k, proposed=proposed, accepted=accepted,
                      emitted=emitted, draft_s=draft_s, verify_s=verify_s, rows=rows or [],
                      drafter_s=drafter_s or {}, gammas=gammas, **kw)

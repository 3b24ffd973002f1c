"""The draft lengths that have a compiled verification of their own: shared by the model side
(`compiled.py` captures one shape per tier) and the policies (their arms). No torch."""

# a step's k; its verification feeds k + 1 tokens (k = 0: a plain step)
SPEC_TIERS = (0, 1, 2, 4, 6, 8)

"""hf_specdec: adaptive, lossless speculative decoding for Hugging Face Transformers.

    hf_specdec.enable(model)
    model.generate(**inputs, assistant_models=[draft], spec_policy=hf_specdec.FixedLength(4))
"""
from .drafters import Drafter, ModelDrafter, PromptLookupDrafter, self_draft
from .enable import disable, enable
from .generate import generate
from .policies import FixedDrafter, FixedLength, SpecPolicy
from .stats import SpecStats, StepRecord
from .verify import VerifyResult, verify

__all__ = ["enable", "disable", "generate", "SpecPolicy", "FixedLength", "FixedDrafter", "Drafter",
           "ModelDrafter", "PromptLookupDrafter", "self_draft", "SpecStats", "StepRecord", "verify",
           "VerifyResult"]
__version__ = "0.1.0"

"""hf_specdec: adaptive, lossless speculative decoding for Hugging Face Transformers.

    hf_specdec.enable(model)
    model.generate(**inputs, assistant_models=[draft], spec_policy=hf_specdec.FixedLength(4))
    model.generate(**inputs, assistant_models=[draft_a, draft_b, hf_specdec.PromptLookupDrafter()],
                   spec_policy=hf_specdec.HedgeSpec())
    model.generate(**inputs, assistant_models=[hf_specdec.HierarchicalDrafter(draft, intermediate)])
"""
from .drafters import (DatastoreDrafter, Drafter, HierarchicalDrafter, ModelDrafter, PromptLookupDrafter, chain,
                       self_draft)
from .enable import disable, enable
from .generate import generate
from .costmodel import CostProfile, LatencyModel, SwitchCostTable
from .policies import (AdaSpec, ConfidenceThreshold, DSDGoodput, EXP3Spec, FixedDrafter, FixedLength, HedgeSpec,
                       HFHeuristic, Nightjar, SpecPolicy, UCBSpec)
from .offload import DraftOffload
from .stats import SpecStats, StepRecord
from .verify import VerifyResult, verify

__all__ = ["enable", "disable", "generate", "SpecPolicy", "FixedLength", "HFHeuristic", "ConfidenceThreshold",
           "Nightjar", "AdaSpec", "DSDGoodput", "CostProfile", "LatencyModel", "SwitchCostTable", "FixedDrafter", "HedgeSpec",
           "UCBSpec", "EXP3Spec", "Drafter", "ModelDrafter", "PromptLookupDrafter", "DatastoreDrafter",
           "HierarchicalDrafter", "chain", "DraftOffload", "self_draft", "SpecStats", "StepRecord", "verify",
           "VerifyResult"]
__version__ = "0.1.0"

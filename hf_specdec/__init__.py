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
from .costmodel import CostProfile
from .policies import (AdaSpec, ConfidenceThreshold, DSDGoodput, FixedDrafter, FixedLength, HedgeSpec, HFHeuristic,
                       MeasuredGoodput, Nightjar, SpecPolicy)
from .offload import DraftOffload
from .stats import SpecStats
from .vocab import TokenizerMismatchWarning

# what users call; research baselines and internals stay in their modules (hf_specdec.policies.UCBSpec,
# hf_specdec.verify.verify, hf_specdec.costmodel.LatencyModel, ...)
__all__ = ["enable", "disable", "generate", "SpecPolicy", "FixedLength", "HFHeuristic", "ConfidenceThreshold",
           "MeasuredGoodput", "Nightjar", "AdaSpec", "DSDGoodput", "HedgeSpec", "FixedDrafter", "Drafter", "ModelDrafter",
           "PromptLookupDrafter", "DatastoreDrafter", "HierarchicalDrafter", "chain", "self_draft", "DraftOffload",
           "SpecStats", "CostProfile", "TokenizerMismatchWarning"]
__version__ = "0.1.0"

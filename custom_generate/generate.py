"""hf_specdec as a Transformers `custom_generate` recipe (the Hub convention: this folder in a repo
or a local checkout).

    model.generate(**inputs, custom_generate="path/to/hf-specdec", trust_remote_code=True,
                   assistant_models=[draft], spec_policy="auto")

Transformers calls `generate(model, **all of generate()'s arguments)`; the call then runs as after
`hf_specdec.enable(model)`: our batched loop when drafters are named (`assistant_models=`, or
Transformers' `assistant_model=` / `prompt_lookup_num_tokens=`), plain `generate()` otherwise.
"""
import functools

from transformers import GenerationMixin

from hf_specdec.enable import call


def generate(model, *args, **kwargs):
    kwargs = {k: v for k, v in kwargs.items() if v is not None}   # generate()'s defaults, as None
    return call(model, functools.partial(GenerationMixin.generate, model), args, kwargs)

"""Transformers version compatibility: the KV cache kwarg (renamed `cache` in 5.24) and the version gate."""
import inspect
import warnings

import pytest
import torch
import transformers

import hf_specdec
from hf_specdec import _compat
from hf_specdec._compat import kv_cache
from hf_specdec.costmodel import profile
from hf_specdec.testing import build, noisy_copy, prompts
from helpers import assert_same


def _deprecations(caught):
    return [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_speculative_call_passes_every_model_kwarg_and_warns_nothing(arch):
    """A rename of a cache kwarg shows up here: generate() hands the loop a kwarg we refuse (a
    ValueError), or our own forwards use a deprecated name (a FutureWarning from transformers)."""
    target = build(arch, 2, seed=0)
    draft = noisy_copy(target, 0.05, seed=1)
    hierarchy = hf_specdec.HierarchicalDrafter(draft=hf_specdec.PromptLookupDrafter(), intermediate=draft)
    ids, mask = prompts(3, seed=2)
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for drafter in (draft, hf_specdec.PromptLookupDrafter(), hierarchy):
            out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10,
                                  custom_generate=hf_specdec.generate, return_dict_in_generate=True,
                                  assistant_models=[drafter], spec_policy="fixed:3")
            assert_same(out.sequences, plain)
            assert out.spec_stats.target_forwards > 0
    assert _deprecations(caught) == [], [str(w.message) for w in _deprecations(caught)]


def test_profiler_forwards_warn_nothing():
    target, draft = build("llama", 2, seed=0), build("llama", 1, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile(target, draft, batch_sizes=(1,), widths=(1, 2, 3), contexts=(4,), lags=(1,), repeats=1, progress=False)
    assert _deprecations(caught) == [], [str(w.message) for w in _deprecations(caught)]


def test_cache_kwarg_follows_the_models_forward_signature():
    class OldStyle(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            return past_key_values

    class NewStyle(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=None):
            return cache

    sentinel = object()
    assert kv_cache.cache_kwargs(OldStyle(), sentinel) == {"past_key_values": sentinel}
    assert kv_cache.cache_kwargs(NewStyle(), sentinel) == {"cache": sentinel}
    model = build("llama", 1)
    name, = kv_cache.cache_kwargs(model, sentinel)
    assert name in inspect.signature(type(model).forward).parameters


def test_cache_from_model_kwargs_reads_either_name():
    sentinel = object()
    assert kv_cache.cache_from_model_kwargs({"cache": sentinel}) is sentinel
    assert kv_cache.cache_from_model_kwargs({"past_key_values": sentinel}) is sentinel
    assert kv_cache.cache_from_model_kwargs({"attention_mask": None}) is None


@pytest.mark.parametrize("version", ["4.57.1", "5.23.0", "5.26.0", "6.0.0"])
def test_unsupported_transformers_is_refused_naming_the_range(version):
    with pytest.raises(ImportError, match=r">=5\.24,<5\.26"):
        _compat.check_transformers_version(version)


def test_installed_transformers_is_supported():
    _compat.check_transformers_version(transformers.__version__)
    _compat.check_transformers_version("5.24.0")
    _compat.check_transformers_version("5.25.1.dev0")


def test_the_library_needs_only_torch_transformers_and_accelerate():
    """Core requirements carry no torch cap (a user's CUDA torch is kept) and nothing only eval uses;
    importing the library loads none of the extras."""
    import subprocess
    import sys
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    names = {req.split(">")[0].split("<")[0].split("=")[0].strip(): req for req in project["dependencies"]}
    assert set(names) <= {"torch", "transformers", "accelerate", "tqdm"}
    assert "<" not in names["torch"]
    assert {"eval", "embedded", "test"} <= set(project["optional-dependencies"])
    extras = ["datasets", "evaluate", "matplotlib", "gguf"]
    loaded = subprocess.run([sys.executable, "-c", "import sys, hf_specdec, hf_specdec.embedded; "
                             f"print([m for m in {extras!r} if m in sys.modules])"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"

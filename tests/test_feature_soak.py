"""The feature-combination soak (feature_soak.py): a concurrent mixed load through the Engine in configurations that
combine speculation, LoRA, the hybrid sliding-window Gemma 3, int4, page sizes, both loops and chunked prefill.

The default run takes `default_slice` (three configurations: every feature on at least once); `-m long` runs the
whole covering array (`pairwise_combos`: every pair of feature levels together). Each run must show no failed
step, no abort the client did not ask for, grammar answers that match, greedy answers equal to the same request run
alone, conservation at idle and bounded RSS.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from feature_soak import LEVELS, Combo, default_slice, pairwise_combos, refused, soak
from lora_support import SPECS, make_peft_adapter
from test_model_support import one_torch_thread

pytestmark = pytest.mark.slow
_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


@pytest.fixture(autouse=True)
def _no_starvation_promotion(monkeypatch):
    # NOTE: a request waiting 30 s goes first; the loaded runs are slow on a shared machine
    monkeypatch.setenv("RADIXSERVE_STARVATION_TIMEOUT_S", "1000000")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """Two PEFT adapters for SmolLM2's shapes (random A and B on a randomly initialised model of its config: only the
    shapes must match) and, when its package is installed, the Gemma 3 270M GGUF file."""
    from transformers import AutoConfig, LlamaForCausalLM

    from radixserve.models.loader import embedded_model_path

    path = embedded_model_path()
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).eval()
    root = tmp_path_factory.mktemp("soak_lora")
    adapters = {}
    for spec in SPECS[:2]:
        make_peft_adapter(base, root / spec.name, spec, b_scale=0.05)
        adapters[spec.name] = root / spec.name
    del base
    out: dict = {"adapters": adapters, "gemma3": None}
    try:
        from test_gemma3_gguf import gemma3_gguf

        out["gemma3"] = gemma3_gguf()
    except pytest.skip.Exception as e:
        out["gemma3_missing"] = str(e)
    return out


def _run(combo: Combo, models: dict, count: int, solo_limit: int, repeat: bool = False) -> None:
    if combo.model == "gemma3" and models["gemma3"] is None:
        pytest.skip(models["gemma3_missing"])
    problems, figures = soak(combo, models, count=count, solo_limit=solo_limit, repeat=repeat)
    assert not problems, f"{combo.label()} {figures}:\n" + "\n".join(problems[:20])
    assert figures["answered"] >= count - count // 9 - 1, figures  # NOTE: every request but the dropped streams


def test_the_covering_array_covers_every_allowed_pair():
    combos = pairwise_combos()
    names = list(LEVELS)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for x in LEVELS[a]:
                for y in LEVELS[b]:
                    probe = Combo(**{a: x, b: y})
                    wanted = refused(probe) is None
                    got = any(getattr(c, a) == x and getattr(c, b) == y for c in combos)
                    assert got == wanted, (a, x, b, y)
    assert all(refused(c) is None for c in combos)
    assert len(combos) <= 14, len(combos)


@pytest.mark.parametrize("combo", default_slice(), ids=Combo.label)
def test_feature_soak_default_slice(combo: Combo, models: dict) -> None:
    _run(combo, models, count=14, solo_limit=4)


@pytest.mark.long
@pytest.mark.parametrize("combo", pairwise_combos(), ids=Combo.label)
def test_feature_soak_every_pair(combo: Combo, models: dict) -> None:
    _run(combo, models, count=24, solo_limit=100, repeat=True)


def test_soak_paths_exist(models: dict) -> None:
    assert all(Path(p).is_dir() for p in models["adapters"].values())

"""CUDA graphs and the Triton backend on a GPU: greedy tokens with graphs on equal graphs off (both loops, page
sizes 1 and 16, float32 and bf16, Gemma 3's window layers over the hybrid pool), the triton backend's tokens equal
the torch backend's (float32), and speculative verify steps run eagerly beside replayed decode steps.

Skipped without a CUDA device; `scripts/gpu_check.sh` runs it (with the other `-m cuda` tests)."""

from __future__ import annotations

import pytest
import torch
from test_cuda import _shared_prefix_prompts
from test_model_gemma3 import _prompts
from test_model_support import assert_engine_conserved

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PARAMS = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


def _run(folder, prompts, params=PARAMS, **kwargs):
    """Output ids, and the graph runner's replays and eager verify steps (None: graphs off)."""
    from radixserve import Engine

    with Engine(model_path=str(folder), device="cuda", max_total_tokens=2048, log_level="warning",
                cuda_graph_max_bs=16, **kwargs) as engine:
        outs = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]
        assert_engine_conserved(engine)
        graphs = engine.model_runner.cuda_graphs
        counts = None if graphs is None else (graphs.replays, graphs.eager_verify_steps)
        assert engine.model_runner.execution_plan.choice("attention backend") == kwargs.get("attention_backend",
                                                                                           "triton")
    return outs, counts


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("normal_loop", [False, True], ids=["overlap", "normal"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_on_equal_graphs_off(tmp_path, dtype, normal_loop, page_size):
    from test_head_shapes import _tiny_llama

    folder = _tiny_llama(tmp_path, 64, 4, 2)
    prompts = _shared_prefix_prompts()
    common = {"dtype": dtype, "page_size": page_size, "disable_overlap_schedule": normal_loop}
    on, counts = _run(folder, prompts, **common)
    off, none = _run(folder, prompts, disable_cuda_graph=True, **common)
    assert none is None and counts[0] >= PARAMS["max_new_tokens"] - 1  # every decode step replayed
    assert on == off


def test_triton_equals_torch_backend_float32(tmp_path):
    from test_head_shapes import _tiny_llama

    folder = _tiny_llama(tmp_path, 128, 4, 2)
    prompts = _shared_prefix_prompts()
    triton_out, _ = _run(folder, prompts, dtype="float32")
    torch_out, counts = _run(folder, prompts, dtype="float32", attention_backend="torch")
    assert counts[0] > 0  # the torch backend's graph hooks replay too
    assert triton_out == torch_out


def test_gemma3_window_layers_under_graphs(tmp_path):
    """Window layers over the hybrid pool (translated slots, window write slots refilled per replay)."""
    from test_model_gemma3 import make_tiny_gemma3

    make_tiny_gemma3(tmp_path)
    prompts = _shared_prefix_prompts()
    common = {"dtype": "float32", "swa_full_tokens_ratio": 0.05}
    on, counts = _run(tmp_path, prompts, **common)
    off, _ = _run(tmp_path, prompts, disable_cuda_graph=True, **common)
    assert counts[0] > 0 and on == off


def test_verify_steps_run_eagerly(tmp_path):
    from test_head_shapes import _tiny_llama

    folder = _tiny_llama(tmp_path, 64, 4, 1)
    loop = _prompts([12], seed=5)[0]
    prompts = [loop * 4, _prompts([30], seed=7)[0]]
    params = {**PARAMS, "max_new_tokens": 32}
    spec, counts = _run(folder, prompts, params, dtype="float32", speculative_algorithm="ngram")
    plain, _ = _run(folder, prompts, params, dtype="float32", disable_cuda_graph=True)
    assert spec == plain and counts[1] > 0, counts

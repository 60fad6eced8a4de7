"""The roofline's bytes and FLOPs against values worked out by hand for SmolLM2-135M's config, and the bound."""

from __future__ import annotations

import pytest

from radixserve.bench import roofline
from radixserve.configs.model_config import ModelConfig

# SmolLM2-135M-Instruct: hidden 576, MLP 1536, 30 layers, 9 heads of 64, 3 KV heads, vocabulary 49,152, tied head.
SMOLLM2 = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, context_len=8192,
                      tie_word_embeddings=True)

# By hand: qkv 576 x (576 + 2 x 192) = 552,960; o 576 x 576 = 331,776; gate_up 576 x 3,072 = 1,769,472;
# down 1,536 x 576 = 884,736; one layer 3,538,944; 30 layers 106,168,320; the head 49,152 x 576 = 28,311,552.
LAYER, LAYERS, HEAD = 3_538_944, 106_168_320, 28_311_552


def test_parameter_counts_of_smollm2() -> None:
    assert roofline.layer_params(SMOLLM2) == LAYER
    assert roofline.head_params(SMOLLM2) == HEAD
    assert roofline.weight_bytes(SMOLLM2, 2) == 268_959_744  # the ~269 MB of bf16 weights a step reads
    assert roofline.weight_bytes(SMOLLM2, 4) == 537_919_488


def test_c_decoder_bytes_and_flops_batch_1() -> None:
    cost = roofline.decode_step(SMOLLM2, [100], bytes_per_weight=2, kv_bytes=4)
    assert cost.weight_bytes == 268_959_744
    # K and V of one token in one layer at float32: 2 x 3 x 64 x 4 = 1,536 bytes; 100 read + 1 written, 30 layers.
    assert cost.kv_bytes == 101 * 30 * 1536 == 4_654_080
    assert cost.linear_flops == 2 * LAYERS == 212_336_640
    assert cost.head_flops == 2 * HEAD == 56_623_104
    # q.k and p.v over 100 tokens: 4 x 576 x 100 per layer.
    assert cost.attention_flops == 4 * 576 * 100 * 30 == 6_912_000


def test_c_decoder_batch_32_is_the_issue_figure() -> None:
    cost = roofline.decode_step(SMOLLM2, [200] * 32, bytes_per_weight=2, kv_bytes=2)
    assert cost.linear_flops + cost.head_flops == 8_606_711_808  # ~8.6 GFLOP of products
    assert cost.head_flops / (cost.linear_flops + cost.head_flops) == pytest.approx(HEAD / (LAYERS + HEAD))  # ~a fifth
    assert cost.kv_bytes == 32 * 201 * 30 * 768
    assert cost.attention_flops == 32 * 4 * 576 * 200 * 30


def test_prefill_counts_causal_pairs_and_one_head_row_per_request() -> None:
    cost = roofline.prefill(SMOLLM2, [512], bytes_per_weight=2, kv_bytes=4)
    assert cost.linear_flops == 2 * 512 * LAYERS
    assert cost.head_flops == 2 * HEAD  # the last token's logits only
    assert cost.attention_flops == 4 * 576 * (512 * 513 // 2) * 30
    assert cost.kv_bytes == 30 * 2 * 512 * 1536  # new K/V written once and read once
    # A cached prefix: its tokens are read, every new token attends to all of them.
    warm = roofline.prefill(SMOLLM2, [10, 20], bytes_per_weight=2, kv_bytes=4, prefixes=[100, 0])
    assert warm.attention_flops == 4 * 576 * 30 * ((10 * 100 + 55) + 210)
    assert warm.head_flops == 2 * 2 * HEAD
    assert warm.kv_bytes == 30 * (100 + 2 * 30) * 1536


def test_sliding_window_layers_attend_to_their_window_only() -> None:
    from dataclasses import replace

    windowed = replace(SMOLLM2, layer_windows=(16,) + (None,) * 29)
    full = roofline.decode_step(SMOLLM2, [100], 2, 4)
    cut = roofline.decode_step(windowed, [100], 2, 4)
    assert full.attention_flops - cut.attention_flops == 4 * 576 * (100 - 16)
    assert roofline.prefill(windowed, [20], 2, 4).attention_flops == 4 * 576 * (
        29 * 210 + sum(min(i, 16) for i in range(1, 21)))


def test_decode_run_sums_its_steps() -> None:
    run = roofline.decode_run(SMOLLM2, [100, 50], steps=3, bytes_per_weight=2, kv_bytes=4)
    steps = [roofline.decode_step(SMOLLM2, [100 + k, 50 + k], 2, 4) for k in (1, 2, 3)]
    assert run == steps[0] + steps[1] + steps[2]
    assert run.weight_bytes == 3 * 268_959_744


def test_bound_is_the_larger_roof_and_the_fraction_its_share() -> None:
    rates = roofline.MachineRates(read_gb_s=31.9, gemm_gflops={"float32": 130.0})
    one = roofline.decode_step(SMOLLM2, [1] * 1, 2, 4)
    assert rates.limit(one, "float32") == "memory"
    assert rates.seconds(one, "float32") == pytest.approx(one.bytes / 31.9e9)
    many = roofline.decode_step(SMOLLM2, [1] * 32, 2, 4)
    assert rates.limit(many, "float32") == "compute"
    assert rates.seconds(many, "float32") == pytest.approx(many.flops / 130e9)
    # The issue's arithmetic: a batch-1 step bound near 118 steps/s, batch 32 near 480 tokens/s.
    assert 1 / rates.seconds(one, "float32") == pytest.approx(118, rel=0.02)
    assert 32 / rates.seconds(many, "float32") == pytest.approx(480, rel=0.02)
    fig = roofline.figure(rates, many, "float32", tokens=32, measured_s=32 / 255)
    assert fig.rate == pytest.approx(255)
    assert fig.fraction == pytest.approx(255 / fig.bound_rate)
    assert roofline.fraction(1.0, 2.0) == 0.5


def test_embedded_model_config_is_the_one_worked_by_hand() -> None:
    from radixserve.model_loader.gguf_loader import gguf_to_hf_folder
    from radixserve.model_loader.model_folder import read_config
    from radixserve.models.loader import embedded_model_path

    cfg = read_config(gguf_to_hf_folder(embedded_model_path(), None))
    assert roofline.layer_params(cfg) == LAYER and roofline.head_params(cfg) == HEAD
    assert cfg.num_layers == 30 and cfg.num_kv_heads * cfg.head_dim == 192


def test_workload_costs_split_prefill_and_decode() -> None:
    fmt = roofline.Formats.of("float32", "bfloat16")
    assert (fmt.bytes_per_weight, fmt.kv_bytes) == (2, 4)
    # Two requests: 100-token prompt with 40 cached, 3 tokens out; 10-token prompt, 1 token out (no decode step).
    pre, dec = roofline.workload_costs(SMOLLM2, fmt, [(100, 40, 3), (10, 0, 1)], prefill_batches=2, decode_batches=2)
    assert pre.linear_flops == 2 * (60 + 10) * LAYERS
    assert pre.head_flops == 2 * 2 * HEAD
    assert pre.weight_bytes == 2 * 268_959_744
    assert pre.attention_flops == 4 * 576 * 30 * ((60 * 40 + 60 * 61 // 2) + 55)
    # Decode: tokens 2 and 3 of the first request attend to 101 and 102 tokens; two steps read the weights twice.
    assert dec.linear_flops == 2 * 2 * LAYERS and dec.head_flops == 2 * 2 * HEAD
    assert dec.attention_flops == 4 * 576 * 30 * (101 + 102)
    assert dec.kv_bytes == 30 * (101 + 102 + 2) * 1536
    assert dec.weight_bytes == 2 * 268_959_744
    assert roofline.Formats.of("bfloat16").kv_bytes == 2


def test_peer_figures_count_their_own_steps() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import peer_roofline

    fmt = roofline.Formats.of("float32", "bfloat16")
    decode = {"name": "decode bs=2", "kind": "decode", "new_tokens": 4, "prompts": [[1] * 100, [1] * 50]}
    cost, tokens = peer_roofline.workload_cost(SMOLLM2, decode, fmt)
    assert tokens == 3 * 2  # the first token comes from the prefill, not a decode step
    assert cost == roofline.decode_run(SMOLLM2, [100, 50], 3, 2, 4)
    cold = {"name": "cold prefill", "kind": "cold", "new_tokens": 1, "prompts": [[1] * 64]}
    assert peer_roofline.workload_cost(SMOLLM2, cold, fmt) == (roofline.prefill(SMOLLM2, [64], 2, 4), 64)
    assert peer_roofline.workload_cost(SMOLLM2, {"name": "W1", "kind": "batch", "prompts": []}, fmt) is None
    rates = roofline.MachineRates(31.9, {"float32": 130.0})
    table = peer_roofline.table(SMOLLM2, {"workloads": [decode, cold]}, rates, {"radixserve": fmt},
                                {"decode bs=2": {"radixserve": 100.0}, "cold prefill": {"radixserve": 300.0}})
    bound, limit = peer_roofline.bounds(SMOLLM2, {"workloads": [decode]}, fmt, rates)["decode bs=2"]
    assert limit == "memory" and "| decode bs=2 | radixserve |" in table and f"{100 / bound:.0%}" in table


def test_bench_roofline_table_sums_prefill_and_decode_bounds() -> None:
    from radixserve.bench.report import roofline_table
    from radixserve.bench.runner import RequestRecord, WorkloadResult

    fmt = roofline.Formats.of("float32", "bfloat16")
    rates = roofline.MachineRates(31.9, {"float32": 130.0})
    records = [RequestRecord(ttft=0.1, e2e=1.0, prompt_tokens=100, completion_tokens=3, cached_tokens=40)]
    result = WorkloadResult("W9", "on", 2.0, records, 60, prefill_batches=1, decode_batches=2)
    pre, dec = roofline.workload_costs(SMOLLM2, fmt, [(100, 40, 3)], 1, 2)
    bound = rates.seconds(pre, "float32") + rates.seconds(dec, "float32")
    table = roofline_table({("W9", "on"): result}, SMOLLM2, fmt, rates)
    assert f"| {bound:.2f} | 2.00 |" in table and f"{bound / 2.0:.0%}" in table
    no_counters = WorkloadResult("W9", "on", 2.0, records, 60)
    assert roofline_table({("W9", "on"): no_counters}, SMOLLM2, fmt, rates) == ""

"""The shape ladder (radixserve/bench/shapes.py): folders in the head geometry of Qwen2.5-0.5B, Llama-3.2-1B and
Qwen2.5-1.5B (fewer layers, a smaller vocabulary and MLP here) load in radixserve and in transformers, and our
float32 forward matches transformers' on them: logits within 1e-4 relative, greedy tokens equal."""

from __future__ import annotations

import pytest
import torch
from direct_driver import DirectDriver
from test_model_support import hf_last_logits, one_torch_thread, rel_err

from radixserve.bench.shapes import SHAPES, Shape, write_folder
from radixserve.mem_cache.conservation import check_conservation
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

TOL = 1e-4
VOCAB = 1024
NEW_TOKENS = 24


def _scaled(name: str) -> Shape:
    return SHAPES[name].scaled(layers=2, vocab=VOCAB, intermediate=512)


@pytest.fixture(scope="module", params=list(SHAPES))
def loaded(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    shape = _scaled(request.param)
    folder = write_folder(shape, tmp_path_factory.mktemp(shape.name) / "model", seed=3, dtype=torch.float32)
    hf_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    runner = ModelRunner(ServerArgs(model_path=str(folder), dtype="float32", device="cpu", max_total_tokens=2048,
                                    attention_backend="cpu"))
    yield shape, folder, hf_model, runner
    report = check_conservation(runner.token_to_kv_pool_allocator, None, runner.req_to_token_pool, [])
    assert report is not None
    assert runner.token_to_kv_pool_allocator.available_size() == runner.max_total_num_tokens


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def test_folder_has_the_shape(loaded):
    shape, _, hf_model, runner = loaded
    cfg = runner.model_config
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        shape.hidden, shape.heads, shape.kv_heads, shape.head_dim)
    assert cfg.attention_bias == (shape.architecture == "qwen2")
    assert cfg.tie_word_embeddings and cfg.rope.theta == shape.rope_theta
    assert cfg.rope.rope_type == ("llama3" if shape.rope_scaling else "default")
    assert sum(p.numel() for p in hf_model.parameters()) == shape.params()


def test_prefill_and_greedy_match_transformers(loaded):
    _, _, hf_model, runner = loaded
    driver = DirectDriver(runner)
    prompts = _prompts([7, 70, 130], seed=1)
    reqs = [driver.new_request() for _ in prompts]
    logits = driver.extend(reqs, prompts)
    for i, prompt in enumerate(prompts):
        assert rel_err(logits[i], hf_last_logits(hf_model, prompt)) < TOL
    ours = [[] for _ in prompts]
    for _ in range(NEW_TOKENS):
        tokens = logits.argmax(-1).tolist()
        for out, token in zip(ours, tokens, strict=True):
            out.append(token)
        logits = driver.decode(reqs, tokens)
    driver.release(reqs)
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            want = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     min_new_tokens=NEW_TOKENS, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == want


def test_rows_past_the_tokenizer_are_zero_and_a_written_folder_is_kept(tmp_path):
    from safetensors.torch import load_file

    from radixserve.bench.shapes import _embedded_tokenizer_folder, _tokenizer_size

    size = _tokenizer_size(_embedded_tokenizer_folder())
    shape = Shape("tiny", "llama", hidden=64, intermediate=128, layers=1, heads=4, kv_heads=2, head_dim=16,
                  vocab=size + 64, rope_theta=1e4, rms_norm_eps=1e-6, max_position=512)
    folder = write_folder(shape, tmp_path / "tiny", seed=0, dtype=torch.float32)
    embed = load_file(str(folder / "model.safetensors"))["model.embed_tokens.weight"]
    assert embed.shape == (size + 64, 64)
    assert not embed[size:].any() and embed[:size].abs().min(dim=1).values.gt(0).all()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert write_folder(shape, tmp_path / "tiny", seed=0, dtype=torch.float32) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    write_folder(shape, tmp_path / "tiny", seed=1, dtype=torch.float32)  # another seed: rewritten
    assert not torch.equal(load_file(str(folder / "model.safetensors"))["model.embed_tokens.weight"], embed)

"""LoRA adapters end to end: PEFT adapters made by `peft` on a tiny model, served by real launcher, router and
shard processes, chosen per request through the OpenAI `model` field (official SDK) and TGI's `adapter_id`.

Oracles: `peft`'s own model for the tokens; the same request alone for the bits of a mixed batch; the base
model and the other adapters for the cache isolation."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests
import torch

from .conftest import Server, start_server, stop_server

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig fields: every projection, a subset, rsLoRA with a larger rank, a small rank, and one
# loaded at run time.
ADAPTERS: dict[str, dict] = {
    "all-r8": dict(r=8, lora_alpha=16, target_modules=TARGETS),
    "qv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp-rs16": dict(
        r=16, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]
    ),
    "attn-r2": dict(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "late-r8": dict(r=8, lora_alpha=32, target_modules=TARGETS),
}
AT_START = ["all-r8", "qv-r4", "mlp-rs16", "attn-r2"]
MAX_LORAS = 4
MAX_NEW_TOKENS = 12
PROMPTS = [f"Story {i}: the {word} went" for i, word in enumerate(["cat", "ship", "river", "lamp"] * 4)]


def save_adapter(base: Path, out: Path, seed: int, config: dict) -> Path:
    """A PEFT LoRA adapter of `base` with random A and B, spread so it changes the greedy tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: save_adapter(tiny_model, root / name, seed, config)
        for seed, (name, config) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def lora_server(
    tiny_model: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    tmp_dir = tmp_path_factory.mktemp("lora-server")
    listed = ",".join(f"{name}={adapters[name]}" for name in AT_START)
    srv = start_server(
        tiny_model,
        tmp_dir,
        "--max-loras", str(MAX_LORAS),
        "--lora-adapters", listed,
        "--enable-lora-loading",
        "--max-batch-size", "32",
    )  # fmt: skip
    yield srv
    stop_server(srv)
    assert srv.process.returncode == 0, srv.log_path.read_text()[-3000:]


def prompt_ids(server: Server, prompt: str) -> list[int]:
    response = requests.post(f"{server.url}/tokenize", json={"prompt": prompt}, timeout=30)
    assert response.status_code == 200, response.text
    return [token["id"] for token in response.json()["tokens"]]


def generate(
    server: Server, prompt: str, adapter: str | None, **parameters: object
) -> list[tuple[int, float]]:
    """(token id, logprob) of each generated token, through TGI's /generate and `adapter_id`."""
    parameters = {"max_new_tokens": MAX_NEW_TOKENS, "details": True, **parameters}
    if adapter is not None:
        parameters["adapter_id"] = adapter
    response = requests.post(
        f"{server.url}/generate", json={"inputs": prompt, "parameters": parameters}, timeout=300
    )
    assert response.status_code == 200, response.text
    return [(token["id"], token["logprob"]) for token in response.json()["details"]["tokens"]]


@torch.no_grad()
def peft_greedy(base: Path, adapter: Path | None, ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of PEFT's model (the base alone when `adapter` is None), stopping at EOS as Rill does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    eos = model.config.eos_token_id
    tokens = list(ids)
    for _ in range(max_new_tokens):
        token = int(model(torch.tensor([tokens])).logits[0, -1].argmax())
        tokens.append(token)
        if token == eos:
            break
    return tokens[len(ids) :]


def detokenize(server: Server, ids: list[int]) -> str:
    response = requests.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["prompt"]


def openai_client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_models_lists_the_adapters_with_their_base(lora_server: Server, adapters: dict[str, Path]) -> None:
    models = {model.id: model for model in openai_client(lora_server).models.list()}
    bases = [model for model in models.values() if getattr(model, "parent", None) is None]
    assert len(bases) == 1, models
    for name in AT_START:
        assert models[name].parent == bases[0].id
        assert models[name].root == str(adapters[name])


@pytest.mark.parametrize("adapter", [None, *AT_START])
def test_tokens_equal_peft(
    lora_server: Server, tiny_model: Path, adapters: dict[str, Path], adapter: str | None
) -> None:
    prompt = PROMPTS[0]
    expected = peft_greedy(tiny_model, adapters.get(adapter), prompt_ids(lora_server, prompt), MAX_NEW_TOKENS)
    assert [token for token, _ in generate(lora_server, prompt, adapter)] == expected
    # The same adapter through the OpenAI SDK's `model`.
    model = adapter or openai_client(lora_server).models.list().data[0].id
    completion = openai_client(lora_server).completions.create(
        model=model, prompt=prompt, max_tokens=MAX_NEW_TOKENS, temperature=0
    )
    assert completion.model == model
    assert completion.choices[0].text == detokenize(lora_server, expected)


def test_adapters_change_the_tokens(lora_server: Server) -> None:
    """Guards the tests above: each adapter answers otherwise than the base and the others."""
    answers = {adapter: generate(lora_server, PROMPTS[1], adapter) for adapter in [None, *AT_START]}
    assert len({tuple(token for token, _ in answer) for answer in answers.values()}) == len(answers)


def test_mixed_batch_gives_each_request_its_bits_alone(lora_server: Server) -> None:
    """16 requests over the base and 4 adapters at once: tokens and logprobs bitwise those of each alone."""
    cases = [(prompt, [None, *AT_START][i % 5]) for i, prompt in enumerate(PROMPTS)]
    alone = [generate(lora_server, prompt, adapter) for prompt, adapter in cases]
    with ThreadPoolExecutor(len(cases)) as pool:
        together = list(pool.map(lambda case: generate(lora_server, *case), cases))
    assert together == alone
    info = lora_server.wait_idle()
    assert info["kv"]["free_blocks"] + info["kv"]["cached_blocks"] == info["kv"]["total_blocks"], info["kv"]


def cached_tokens(server: Server, model: str, prompt: str) -> int:
    completion = openai_client(server).completions.create(
        model=model, prompt=prompt, max_tokens=2, temperature=0
    )
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    return completion.usage.prompt_tokens_details.cached_tokens or 0


def test_adapters_never_share_cached_kv(lora_server: Server) -> None:
    prompt = "A long shared opening that fills several KV blocks. " * 12
    base = openai_client(lora_server).models.list().data[0].id
    first = cached_tokens(lora_server, "all-r8", prompt)
    assert cached_tokens(lora_server, "all-r8", prompt) > first
    assert cached_tokens(lora_server, "qv-r4", prompt) == 0, "another adapter read all-r8's KV"
    assert cached_tokens(lora_server, base, prompt) == 0, "the base model read an adapter's KV"
    assert cached_tokens(lora_server, base, prompt) > 0


def test_unknown_adapters_are_named_in_a_404(lora_server: Server) -> None:
    with pytest.raises(openai.NotFoundError, match="no-such-adapter"):
        openai_client(lora_server).completions.create(model="no-such-adapter", prompt="Hi", max_tokens=2)
    response = requests.post(
        f"{lora_server.url}/generate",
        json={"inputs": "Hi", "parameters": {"max_new_tokens": 2, "adapter_id": "no-such-adapter"}},
        timeout=30,
    )
    assert response.status_code == 404, response.text
    assert "no-such-adapter" in response.text


def test_load_serve_unload_under_load(
    lora_server: Server, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """An adapter loaded, served and unloaded at run time while other requests (base and adapters) keep
    running: none of them fails, requests already running on the unloaded adapter finish, later ones get
    a 404, and more adapters than slots in flight at once only wait."""
    failures: list[str] = []
    stop = threading.Event()

    def background(adapter: str | None) -> None:
        while not stop.is_set():
            try:
                generate(lora_server, PROMPTS[2], adapter, max_new_tokens=6)
            except AssertionError as error:
                failures.append(f"{adapter}: {error}")

    threads = [threading.Thread(target=background, args=(a,)) for a in [None, *AT_START]]
    for thread in threads:
        thread.start()
    try:
        url = lora_server.url
        load = requests.post(
            f"{url}/v1/load_lora_adapter",
            json={"lora_name": "late-r8", "lora_path": str(adapters["late-r8"])},
            timeout=120,
        )
        assert load.status_code == 200, load.text
        prompt = PROMPTS[3]
        expected = peft_greedy(
            tiny_model, adapters["late-r8"], prompt_ids(lora_server, prompt), MAX_NEW_TOKENS
        )
        assert [token for token, _ in generate(lora_server, prompt, "late-r8")] == expected
        # Five adapters in flight with four slots: one waits for a slot, none fails.
        answers: list[list[tuple[int, float]]] = []
        with ThreadPoolExecutor(4) as pool:
            running = [
                pool.submit(generate, lora_server, prompt, "late-r8", max_new_tokens=300) for _ in range(4)
            ]
            time.sleep(0.3)
            metrics = requests.get(f"{url}/metrics", timeout=10).text
            info_line = next(
                line for line in metrics.splitlines() if line.startswith("rill_lora_requests_info")
            )
            assert "late-r8" in info_line.split("waiting_lora_adapters")[0], "late-r8 should be running"
            unload = requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late-r8"}, timeout=60)
            assert unload.status_code == 200, unload.text
            for future in running:
                answers.append(future.result())
        assert answers[0] and all(answer == answers[0] for answer in answers)
        gone = requests.post(
            f"{url}/generate",
            json={"inputs": prompt, "parameters": {"max_new_tokens": 2, "adapter_id": "late-r8"}},
            timeout=30,
        )
        assert gone.status_code == 404, gone.text
        assert "late-r8" not in {model.id for model in openai_client(lora_server).models.list()}
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert not failures, failures[:3]
    info = lora_server.wait_idle()
    assert info["kv"]["free_blocks"] + info["kv"]["cached_blocks"] == info["kv"]["total_blocks"], info["kv"]

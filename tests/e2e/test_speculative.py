"""End to end: speculative decoding (`--speculative ngram`) changes no token, only how many come per step.

Oracles: the same server without speculation (itself checked against `transformers` in test_serving.py) on
the same requests, greedy and seeded; a roomy pool without speculation for the preemption run; and a χ²
test of homogeneity between many seeded draws with speculation on and off. The counters show that
proposals were made and accepted, so none of this passes by speculating nothing.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from .conftest import SERVER_FLAGS, Server, start_server, stop_server
from .test_preemption import metric
from .test_serving import PROMPT, generate, token_ids

SPECULATIVE = ("--speculative", "ngram", "--num-speculative-tokens", "4")
CODE = """def merge(left, right):
    result = []
    while left and right:
        if left[0] <= right[0]:
            result.append(left.pop(0))
        else:
            result.append(right.pop(0))
    return result + left + right
"""
QUOTE = (
    "The river rose in the night and carried the old bridge away. By morning the village had only the "
    "ferry, and the ferryman charged twice what he had charged the week before."
)
# Text that repeats its context (where proposals are accepted) and text that does not.
PROMPTS = [
    f"Copy this code exactly:\n\n{CODE}\nCopy:\n\n",
    f"{CODE}\n# The same function again, unchanged:\n",
    f'Quote the first sentence of this passage. Passage: "{QUOTE}" Quote: "',
    "one two three four five one two three four five one two three",
    PROMPT,
    "Tell me a joke.",
]


def counters(server: Server) -> dict[str, float]:
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    names = ("drafts", "draft_tokens", "accepted_tokens")
    return {name: metric(text, f"rill_spec_decode_num_{name}_total") for name in names}


@pytest.fixture(scope="module")
def speculative_server(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The session `server`'s flags (the default model), with n-gram speculation."""
    server = start_server(default_model, tmp_path_factory.mktemp("speculative"), *SERVER_FLAGS, *SPECULATIVE)
    yield server
    stop_server(server)
    assert server.process.returncode == 0, server.log_path.read_text()[-3000:]


def test_greedy_tokens_are_those_without_speculation(server: Server, speculative_server: Server) -> None:
    before = counters(speculative_server)
    for prompt in PROMPTS:
        expected = generate(server, prompt, max_new_tokens=48)
        result = generate(speculative_server, prompt, max_new_tokens=48)
        assert token_ids(result) == token_ids(expected), prompt
        assert result["generated_text"] == expected["generated_text"]
        assert [t["logprob"] for t in result["details"]["tokens"]] == [
            t["logprob"] for t in expected["details"]["tokens"]
        ]
    after = counters(speculative_server)
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    proposed = after["draft_tokens"] - before["draft_tokens"]
    print(f"accepted {accepted:.0f} of {proposed:.0f} proposed tokens")
    assert accepted > 48, "the copying prompts are proposed and accepted"
    assert accepted < proposed, "some proposals are wrong"
    assert counters(server)["draft_tokens"] == 0


def mixed_requests() -> list[tuple[str, dict]]:
    """16 requests: greedy of several lengths, stop strings, seeded sampling with every warper, penalties,
    top tokens; most on text that repeats its context."""
    requests_ = []
    for i in range(16):
        prompt = PROMPTS[i % len(PROMPTS)]
        params: dict = {"max_new_tokens": 8 + 7 * (i % 6)}
        if i % 4 == 1:
            params.update(do_sample=True, temperature=0.7, top_k=40, top_p=0.9, seed=100 + i)
        if i % 4 == 2:
            params.update(repetition_penalty=1.2, top_n_tokens=3)
        if i % 4 == 3:
            params.update(stop=["\n\n", "five one", "result"])
        if i % 8 == 5:
            params.update(frequency_penalty=0.5)
        requests_.append((prompt, params))
    return requests_


def test_a_batch_of_16_mixed_requests_gets_the_tokens_each_gets_alone(
    server: Server, speculative_server: Server
) -> None:
    batch = mixed_requests()
    alone = [generate(server, prompt, **params) for prompt, params in batch]
    speculative_server.wait_idle()
    before = counters(speculative_server)
    with ThreadPoolExecutor(len(batch)) as pool:
        together = list(
            pool.map(lambda request: generate(speculative_server, request[0], **request[1]), batch)
        )
    for (prompt, params), expected, result in zip(batch, alone, together, strict=True):
        assert result["generated_text"] == expected["generated_text"], (prompt, params)
        assert result["details"]["finish_reason"] == expected["details"]["finish_reason"]
        assert result["details"]["tokens"] == expected["details"]["tokens"], (prompt, params)
        if "top_n_tokens" in params:
            assert result["details"]["top_tokens"] == expected["details"]["top_tokens"]
    assert any(r["details"]["finish_reason"] == "stop_sequence" for r in together)
    assert counters(speculative_server)["accepted_tokens"] > before["accepted_tokens"]
    kv = speculative_server.wait_idle()["kv"]
    assert kv["used_blocks"] == 0 and kv["free_blocks"] + kv["cached_blocks"] == kv["total_blocks"], kv


def test_a_seed_gives_the_same_text_alone_in_a_batch_and_without_speculation(
    server: Server, speculative_server: Server
) -> None:
    params = {"max_new_tokens": 24, "do_sample": True, "temperature": 0.8, "top_p": 0.95, "seed": 77}
    prompt = PROMPTS[0]
    alone = generate(speculative_server, prompt, **params)
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(generate, speculative_server, p, max_new_tokens=24) for p in PROMPTS[1:4]]
        together = generate(speculative_server, prompt, **params)
        assert all(other.result()["details"]["generated_tokens"] > 0 for other in others)
    assert token_ids(together) == token_ids(alone)
    assert token_ids(generate(server, prompt, **params)) == token_ids(alone)


DRAW_PROMPT = "one two three four five one two three four five one two three four five one two"
NUM_DRAWS = 240


def draws(server: Server, seeds: range) -> Counter[str]:
    """Short sampled continuations of a repeating prompt, one per seed, 4 at a time (so the steps have room
    for proposals under --speculative-max-step-tokens)."""

    def draw(seed: int) -> str:
        params = {"max_new_tokens": 6, "do_sample": True, "temperature": 0.7, "seed": seed}
        tokens = generate(server, DRAW_PROMPT, **params)["details"]["tokens"]
        return "".join(token["text"] for token in tokens[:3])

    with ThreadPoolExecutor(4) as pool:
        return Counter(pool.map(draw, seeds))


def chi2_homogeneity_p_value(table: list[list[int]]) -> float:
    """Pearson's χ² test that the rows of a contingency table are draws from one distribution."""
    observed = torch.tensor(table, dtype=torch.float64)
    expected = observed.sum(1, keepdim=True) * observed.sum(0, keepdim=True) / observed.sum()
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = (observed.shape[0] - 1) * (observed.shape[1] - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def test_sampled_continuations_are_distributed_as_without_speculation(
    server: Server, speculative_server: Server
) -> None:
    before = counters(speculative_server)
    on = draws(speculative_server, range(NUM_DRAWS))
    off = draws(server, range(NUM_DRAWS, 2 * NUM_DRAWS))  # other seeds: independent samples
    after = counters(speculative_server)
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    print(f"{accepted:.0f} of {after['draft_tokens'] - before['draft_tokens']:.0f} proposed tokens accepted")
    assert accepted > NUM_DRAWS / 4, "the draws were speculated"
    # Continuations seen at least 5 times on either side are their own category; the rest are pooled.
    common = sorted(text for text in on.keys() | off.keys() if on[text] + off[text] >= 10)
    assert len(common) >= 2, (on, off)
    table = [
        [side[text] for text in common] + [sum(side.values()) - sum(side[text] for text in common)]
        for side in (on, off)
    ]
    table = [[row[j] for j in range(len(table[0])) if table[0][j] + table[1][j] > 0] for row in table]
    p_value = chi2_homogeneity_p_value(table)
    print(f"{len(common)} common continuations, chi2 p = {p_value:.3f}: {table}")
    assert p_value > 0.001


def test_speculating_sequences_survive_preemption(
    server: Server, default_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """16 greedy requests on a pool with room for about a third of them, speculating (up to 64 tokens a
    step, so proposals ride along however many run): each gets the tokens the roomy server without
    speculation gives alone, and every block comes back."""
    batch = [(f"Request {i}. {PROMPTS[i % 4]}", {"max_new_tokens": 40}) for i in range(16)]
    expected = [token_ids(generate(server, prompt, **params)) for prompt, params in batch]
    tiny = start_server(
        default_model,
        tmp_path_factory.mktemp("speculative-tiny-pool"),
        "--max-batch-total-tokens",
        "768",
        "--swap-space",
        "0.01",
        *SPECULATIVE,
        "--speculative-max-step-tokens",
        "64",
    )
    try:
        with ThreadPoolExecutor(len(batch)) as pool:
            outputs = list(
                pool.map(lambda request: token_ids(generate(tiny, request[0], **request[1])), batch)
            )
        kv = tiny.wait_idle()["kv"]
        metrics = requests.get(f"{tiny.url}/metrics", timeout=10).text
    finally:
        stop_server(tiny)
    assert outputs == expected
    preemptions = {
        mode: metric(metrics, f'rill_preemptions_total{{mode="{mode}"}}') for mode in ("recompute", "swap")
    }
    accepted = metric(metrics, "rill_spec_decode_num_accepted_tokens_total")
    print(f"preemptions {preemptions}, {accepted:.0f} proposed tokens accepted")
    assert sum(preemptions.values()) > 0
    assert accepted > 0
    assert kv["used_blocks"] == 0 and kv["free_blocks"] + kv["cached_blocks"] == kv["total_blocks"], kv
    assert metric(metrics, "rill_swap_blocks_free") == metric(metrics, "rill_swap_blocks_total")


# Draft-model speculation (`--speculative draft`): tiny random Llamas with the default model's tokenizer
# (no small real pair with one tokenizer ships on PyPI). A target used as its own draft proposes exactly
# what the target samples greedily (the float32 forward is batch-invariant), so every proposal is accepted:
# that proves the plumbing (catch-up, one call per draft token). The target cut to one layer agrees with it
# only sometimes: its rejections and rollbacks must change no token either, greedy or seeded.
DRAFT_PROMPTS = [*PROMPTS, "Count: 1, 2, 3, 4,", "Once upon a time"]


@pytest.fixture(scope="module")
def small_draft(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target cut to its first layer (same embeddings, head and tokenizer): a smaller draft that
    agrees with the target on some tokens and not on others."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("small-draft")
    config = json.loads((tiny_model / "config.json").read_text())
    num_layers = config["num_hidden_layers"]
    assert num_layers > 1
    config["num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    weights = load_file(tiny_model / "model.safetensors")
    kept = {
        name: tensor
        for name, tensor in weights.items()
        if not any(f".layers.{layer}." in name for layer in range(1, num_layers))
    }
    save_file(kept, path / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, path / name)
    return path


def serve_concurrently(server: Server, batch: list[tuple[str, dict]]) -> list[dict]:
    with ThreadPoolExecutor(len(batch)) as pool:
        return list(pool.map(lambda request: generate(server, request[0], **request[1]), batch))


def test_a_draft_model_changes_no_token(
    tiny_model: Path, small_draft: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    greedy = [(prompt, {"max_new_tokens": 12 + 5 * i}) for i, prompt in enumerate(DRAFT_PROMPTS)]
    seeded = [
        (prompt, {"max_new_tokens": 20, "do_sample": True, "temperature": 0.8, "top_p": 0.9, "seed": 5 + i})
        for i, prompt in enumerate(DRAFT_PROMPTS[:3])
    ]
    pool = ("--max-batch-tokens", "256", "--max-batch-total-tokens", "8000", "--max-batch-size", "16")
    plain = start_server(tiny_model, tmp_path_factory.mktemp("draft-plain"), *pool)
    try:
        expected = [generate(plain, prompt, **params) for prompt, params in greedy + seeded]
    finally:
        stop_server(plain)
    for draft, batch in ((tiny_model, greedy), (small_draft, greedy + seeded)):
        server = start_server(
            tiny_model,
            tmp_path_factory.mktemp("draft"),
            *pool,
            "--speculative",
            "draft",
            "--draft-model-id",
            str(draft),
            "--num-speculative-tokens",
            "4",
        )
        try:
            results = serve_concurrently(server, batch)
            spec = counters(server)
            kv = server.wait_idle()["kv"]
        finally:
            stop_server(server)
        assert server.process.returncode == 0, server.log_path.read_text()[-3000:]
        for (prompt, params), want, result in zip(batch, expected[: len(batch)], results, strict=True):
            assert token_ids(result) == token_ids(want), (draft.name, prompt, params)
            assert result["generated_text"] == want["generated_text"]
            assert result["details"]["finish_reason"] == want["details"]["finish_reason"]
        print(f"{draft.name}: accepted {spec['accepted_tokens']:.0f} of {spec['draft_tokens']:.0f} proposed")
        assert spec["drafts"] > 0
        if draft == tiny_model:
            assert all(result["details"]["finish_reason"] == "length" for result in results)
            assert spec["accepted_tokens"] == spec["draft_tokens"], "a model agrees with itself"
        else:
            assert 0 < spec["accepted_tokens"] < spec["draft_tokens"], "a cut draft agrees only sometimes"
        assert kv["used_blocks"] == 0 and kv["free_blocks"] + kv["cached_blocks"] == kv["total_blocks"], kv


def test_a_draft_model_under_preemption_with_stop_strings(
    tiny_model: Path, small_draft: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """16 concurrent requests (greedy, seeded, some ended by a stop string) with the cut draft on a pool with
    room for a few of them: each gets what a roomy server without speculation gives it, and both pools are
    whole when idle."""
    batch = [(f"{DRAFT_PROMPTS[i % len(DRAFT_PROMPTS)]} ({i})", {"max_new_tokens": 40}) for i in range(16)]
    for i, (_, params) in enumerate(batch):
        if i % 4 == 1:
            params.update(do_sample=True, temperature=0.8, seed=40 + i)
    roomy = ("--max-batch-tokens", "256", "--max-batch-total-tokens", "8000", "--max-batch-size", "16")
    plain = start_server(tiny_model, tmp_path_factory.mktemp("draft-stop-plain"), *roomy)
    try:
        unstopped = [generate(plain, prompt, **params)["generated_text"] for prompt, params in batch]
        for i, (_, params) in enumerate(batch):
            words = unstopped[i].split()
            if i % 4 == 3 and len(words) > 8:
                params["stop"] = [words[len(words) // 2]]  # fires mid-answer, maybe mid-proposal
        expected = [generate(plain, prompt, **params) for prompt, params in batch]
    finally:
        stop_server(plain)
    assert any(result["details"]["finish_reason"] == "stop_sequence" for result in expected)
    tiny_pool = ("--max-batch-tokens", "256", "--max-batch-total-tokens", "384", "--swap-space", "0.01")
    draft_flags = ("--speculative", "draft", "--draft-model-id", str(small_draft))
    server = start_server(tiny_model, tmp_path_factory.mktemp("draft-stop"), *tiny_pool, *draft_flags)
    try:
        results = serve_concurrently(server, batch)
        spec = counters(server)
        kv = server.wait_idle()["kv"]
        metrics = requests.get(f"{server.url}/metrics", timeout=10).text
    finally:
        stop_server(server)
    for (prompt, params), want, result in zip(batch, expected, results, strict=True):
        assert token_ids(result) == token_ids(want), (prompt, params)
        assert result["details"]["finish_reason"] == want["details"]["finish_reason"]
    preemptions = sum(
        metric(metrics, f'rill_preemptions_total{{mode="{mode}"}}') for mode in ("recompute", "swap")
    )
    print(
        f"preemptions {preemptions:.0f}, accepted {spec['accepted_tokens']:.0f} of {spec['draft_tokens']:.0f}"
    )
    assert preemptions > 0
    assert spec["accepted_tokens"] > 0
    assert kv["used_blocks"] == 0 and kv["free_blocks"] + kv["cached_blocks"] == kv["total_blocks"], kv
    assert 0 < kv["draft_free_blocks"] == kv["draft_total_blocks"], kv

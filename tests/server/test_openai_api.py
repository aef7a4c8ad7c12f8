"""The official ``openai`` client against a live server on 127.0.0.1 (real SmolLM2-135M-Instruct, CPU).

Expected greedy texts come from the offline engine on the same weights (checked by hand once):
"The capital of France is" -> " Paris.\\n\\nThe answer is:" (8 tokens).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024  # as in conftest.py
MAX_NUM_SEQS = 8

PARIS = "The capital of France is"
PARIS_8 = " Paris.\n\nThe answer is:"
PARIS_8_IDS = [7042, 30, 198, 198, 504, 2988, 314, 42]


@pytest.fixture(scope="module")
def server(async_engine):
    from roofline.server.app import BackgroundServer, build_app

    app = build_app(async_engine)
    with BackgroundServer(app) as srv:
        srv.app = app
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.app.state.serving.tokenizer


def _chat_prompt_len(tokenizer, messages) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def test_models_and_health(server, client, async_engine):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]  # one id for the default model (87a5992 listed two)
    alias = async_engine.engine.model_config.name  # the config's spelling, still accepted in ``model``
    assert alias != MODEL
    assert client.completions.create(model=alias, prompt=PARIS, max_tokens=1, temperature=0).choices
    r = httpx.get(server.url + "/v1/models")
    assert r.json()["data"][0]["max_model_len"] == MAX_MODEL_LEN
    h = httpx.get(server.url + "/health")
    assert (h.status_code, h.json()) == (200, {"status": "ok"})
    # OpenAI's retrieve-model: the listed id and the alias answer, an unknown id is a 404 naming it.
    assert client.models.retrieve(MODEL).id == MODEL and client.models.retrieve(alias).id == alias
    missing = httpx.get(server.url + "/v1/models/no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert '"no-such-model"' in missing.json()["error"]["message"]
    # Both 404s name what /v1/models lists, not the alias (which it does not list).
    bad = httpx.post(server.url + "/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
    for r in (missing, bad):
        assert r.json()["error"]["message"].endswith(f"this server serves: {MODEL}"), r.json()


def test_completion_greedy_text_usage_and_finish_reason(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == PARIS_8
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer(PARIS).input_ids) == 5
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == 13


def test_completion_token_id_prompt_and_prompt_list(client, tokenizer):
    ids = tokenizer(PARIS).input_ids
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == PARIS_8
    # A list of prompts: choices are indexed prompt * n + sample; usage sums over prompts.
    other = "The capital of Germany is"
    r = client.completions.create(model=MODEL, prompt=[PARIS, other], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text == " Paris.\n\n"
    assert r.choices[2].text == r.choices[3].text
    assert r.usage.prompt_tokens == len(tokenizer(PARIS).input_ids) + len(tokenizer(other).input_ids)
    assert r.usage.completion_tokens == 4 * 4


def test_completion_echo(client):
    r = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=8, temperature=0, echo=True)
    assert r.choices[0].text == PARIS + PARIS_8
    s = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=8, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in s if c.choices) == PARIS + PARIS_8


def test_completion_logprobs_legacy_format(client):
    r = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [" Paris", ".", "\n", "\n", "The", " answer", " is", ":"]
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [0, 6, 7, 8, 9, 12, 19, 22]
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0.0
        assert len(top) == 2  # greedy: the sampled token is the top-1, so no extra entry
        assert top[token] == logprob == max(top.values())  # greedy picks the most likely token
    assert lp.token_logprobs[0] == pytest.approx(-0.258, abs=0.01)  # P(" Paris") ~ 0.77


def _offsets(tokens: list[str], start: int = 0) -> list[int]:
    out = []
    for t in tokens:
        out.append(start)
        start += len(t)
    return out


def test_completion_echo_max_tokens_0_scores_the_prompt(server, client, tokenizer):
    """lm-eval-harness's loglikelihood request: the prompt alone, one legacy entry per prompt token, the
    first null; the values equal the sampled-token logprobs of the same positions (another code path)."""
    ids = tokenizer(PARIS).input_ids
    r = client.completions.create(model=MODEL, prompt=ids + [PARIS_8_IDS[0]], max_tokens=0, echo=True, logprobs=5,
                                  temperature=0)
    c = r.choices[0]
    assert c.text == PARIS + " Paris" and c.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (6, 0)
    lp = c.logprobs
    assert lp.tokens == ["The", " capital", " of", " France", " is", " Paris"]
    assert lp.text_offset == _offsets(lp.tokens) and "".join(lp.tokens) == c.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert logprob < 0 and top[token] == logprob
        assert len(top) in (5, 6)  # the top 5, and the prompt token when it is not among them
        assert max(top.values()) >= logprob
    assert len(lp.top_logprobs[-1]) == 5 and max(lp.top_logprobs[-1].values()) == lp.token_logprobs[-1]
    # " Paris" after the prompt, as the first sampled token of a plain request (test above: ~ -0.258).
    sampled = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=1, temperature=0, logprobs=5)
    assert lp.token_logprobs[-1] == pytest.approx(sampled.choices[0].logprobs.token_logprobs[0], abs=1e-4)
    assert lp.top_logprobs[-1] == pytest.approx(sampled.choices[0].logprobs.top_logprobs[0], abs=1e-4)
    # Raw JSON: the first entries are null, no vLLM prompt_logprobs unless asked.
    raw = httpx.post(server.url + "/v1/completions", json={"prompt": PARIS, "max_tokens": 0, "echo": True,
                                                           "logprobs": 1}, timeout=60).json()
    choice = raw["choices"][0]
    assert choice["logprobs"]["token_logprobs"][0] is None and choice["logprobs"]["top_logprobs"][0] is None
    assert "prompt_logprobs" not in choice and choice["text"] == PARIS


def test_completion_echo_with_generation_returns_prompt_then_completion_logprobs(client):
    plain = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=8, temperature=0, logprobs=2)
    r = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=8, temperature=0, logprobs=2, echo=True)
    c, lp, want = r.choices[0], r.choices[0].logprobs, plain.choices[0].logprobs
    assert c.text == PARIS + PARIS_8 and r.usage.completion_tokens == 8
    assert lp.tokens == ["The", " capital", " of", " France", " is"] + want.tokens
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert lp.token_logprobs[5:] == pytest.approx(want.token_logprobs, abs=1e-4)
    assert lp.text_offset == _offsets(lp.tokens[:5]) + _offsets(want.tokens, len(PARIS))
    assert all(len(top) == 2 for top in lp.top_logprobs[5:])  # greedy: the token is the top-1
    # Streamed: the first chunk carries the prompt and its logprobs; the concatenation is the same.
    chunks = [ch for ch in client.completions.create(model=MODEL, prompt=PARIS, max_tokens=8, temperature=0,
                                                     logprobs=2, echo=True, stream=True) if ch.choices]
    assert chunks[0].choices[0].text.startswith(PARIS) and chunks[0].choices[0].logprobs.tokens[:5] == lp.tokens[:5]
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    streamed = {field: [x for ch in chunks for x in getattr(ch.choices[0].logprobs, field)]
                for field in ("tokens", "token_logprobs", "text_offset")}
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"][0] is None
    assert streamed["token_logprobs"][1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    # Streamed echo with max_tokens 0: one chunk, the prompt, finish "length".
    only = [ch for ch in client.completions.create(model=MODEL, prompt=PARIS, max_tokens=0, echo=True, logprobs=1,
                                                   stream=True) if ch.choices]
    assert [(ch.choices[0].text, ch.choices[0].finish_reason) for ch in only] == [(PARIS, "length")]
    assert only[0].choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:5], abs=1e-4)


def test_completion_prompt_logprobs_extension_vllm_layout(server, tokenizer):
    ids = tokenizer(PARIS).input_ids
    body = {"prompt": PARIS, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3}
    choice = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    plps = choice["prompt_logprobs"]
    assert choice["text"] == " Paris." and choice["logprobs"] is None
    assert len(plps) == len(ids) and plps[0] is None
    for i in range(1, len(ids)):
        entry = plps[i]
        actual = entry[str(ids[i])]
        assert actual["decoded_token"] == tokenizer.decode([ids[i]]) and actual["logprob"] < 0
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:3] == [1, 2, 3] and len(entry) == 3 + (actual["rank"] > 3)
    streamed = httpx.post(server.url + "/v1/completions", json=body | {"stream": True}, timeout=60).text
    first = json.loads(streamed.split("\n\n")[0].removeprefix("data: "))["choices"][0]
    assert first["prompt_logprobs"] == plps


def test_completion_stream_matches_and_include_usage(client):
    chunks = list(client.completions.create(model=MODEL, prompt=PARIS, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == PARIS_8
    assert len(text_chunks) >= 4  # streamed, not one blob
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == 5 and chunks[-1].usage.total_tokens == 13
    assert all(c.usage is None for c in chunks[:-1])
    # Without include_usage there is no usage chunk.
    plain = list(client.completions.create(model=MODEL, prompt=PARIS, max_tokens=3, temperature=0, stream=True))
    assert all(c.choices and c.usage is None for c in plain)


def test_stop_string_streamed_and_not(client):
    r = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=8, temperature=0, stop=["\n"])
    assert r.choices[0].text == " Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == "\n"
    assert r.usage.completion_tokens == 3  # " Paris", ".", "\n": the stop string's token is counted
    s = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=8, temperature=0, stop="answer",
                                  stream=True)
    chunks = list(s)
    assert "".join(c.choices[0].text for c in chunks) == " Paris.\n\nThe "
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stream_never_splits_utf8(client):
    # Byte-fallback tokens: several tokens make one CJK character. No delta may hold U+FFFD.
    prompt = "中国的首都是"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert full.choices[0].text == "一位美丽的美"
    deltas = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                                   temperature=0, stream=True)]
    assert "".join(deltas) == "一位美丽的美"
    assert all("\ufffd" not in d for d in deltas)


def test_sampling_extensions_and_penalties(client):
    # top_k=1 (extension) makes any temperature greedy; min_p=1 keeps only the most likely token.
    r = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=8, temperature=1.5,
                                  extra_body={"top_k": 1})
    assert r.choices[0].text == PARIS_8
    r = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=8, temperature=1.5,
                                  extra_body={"min_p": 1.0})
    assert r.choices[0].text == PARIS_8
    # frequency_penalty=2 forbids the second "\n" of the greedy text.
    r = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=8, temperature=0, frequency_penalty=2.0)
    assert r.choices[0].text == " Paris.\n- The United States has"
    r = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=8, temperature=0, presence_penalty=2.0)
    assert r.choices[0].text.count("\n\n") == 0


def test_seed_makes_sampling_reproducible(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b
    many = client.completions.create(**kw, n=3)
    assert many.usage.completion_tokens == 36


def test_chat_system_message_n_and_usage(client, tokenizer):
    messages = [{"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, n=2,
                                       temperature=0.8, seed=7)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.role == "assistant" and c.message.content for c in r.choices)
    assert r.usage.prompt_tokens == _chat_prompt_len(tokenizer, messages)
    # The system message reaches the prompt: 50 more words in it give 50 more prompt tokens.
    longer = [{"role": "system", "content": "You are a terse assistant." + " word" * 50}, messages[1]]
    r2 = client.chat.completions.create(model=MODEL, messages=longer, max_tokens=1, temperature=0)
    assert r2.usage.prompt_tokens == r.usage.prompt_tokens + 50
    lengths = [len(tokenizer(c.message.content, add_special_tokens=False).input_ids) for c in r.choices]
    assert r.usage.completion_tokens <= 20 and r.usage.completion_tokens >= sum(lengths) - 2
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    greedy = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    assert "Paris" in greedy.choices[0].message.content
    assert greedy.choices[0].finish_reason == "stop"  # ended with <|im_end|> before 30 tokens
    assert greedy.usage.completion_tokens < 30


def test_chat_max_tokens_and_max_completion_tokens(client):
    messages = [{"role": "user", "content": "Tell me a long story about a dragon."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (3, "length")
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, max_completion_tokens=2,
                                       temperature=0)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (2, "length")


def test_chat_stream_role_content_finish_usage(client):
    messages = [{"role": "user", "content": "Say hello."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() | {"completion_tokens_details": None, "prompt_tokens_details": None} == \
        full.usage.model_dump() | {"completion_tokens_details": None, "prompt_tokens_details": None}


def test_chat_logprobs_chat_format(client):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        assert bytes(e.bytes).decode() == e.token
    # logprobs without top_logprobs: the sampled token only.
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0, logprobs=True)
    assert [len(e.top_logprobs) for e in r.choices[0].logprobs.content] == [0, 0]
    # Streamed: one entry per token across chunks.
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=1, stream=True))
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in content]


def test_64_concurrent_streams_complete_with_exact_usage(server, tokenizer):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    prompts = [f"Count from {i} to {i + 5}:" for i in range(64)]

    async def one(prompt: str) -> tuple[str, int, int, str | None]:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        return text, usage.prompt_tokens, usage.completion_tokens, finish

    async def main():
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == 64
    for prompt, (text, prompt_tokens, completion_tokens, finish) in zip(prompts, results, strict=True):
        assert prompt_tokens == len(tokenizer(prompt).input_ids)
        assert completion_tokens == 6 and finish == "length"
        assert text
    assert MAX_NUM_SEQS < 64  # so most of them queued before running

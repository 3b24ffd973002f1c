"""`python -m hf_specdec serve`: Transformers' OpenAI-compatible server with a speculating continuous
batching, started as a user starts it and asked by the `openai` client, against `transformers serve`
itself on the same model (SmolLM2-135M, float32; its first 4 layers as the draft)."""
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the [serve] extra: pip install '.[serve]'")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "eval"))
from bench_serve import Server, save_float32  # noqa: E402  (the servers as eval/bench_serve.py runs them)

QUESTIONS = ["Write a Python function that adds two numbers.", "What is the capital of France?",
             "List three prime numbers.", "Explain recursion in one sentence."]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def servers(smollm2, tmp_path_factory):
    model, tokenizer = smollm2
    where = tmp_path_factory.mktemp("serve")
    target = save_float32(model, tokenizer, model.config.num_hidden_layers, where / "target")
    draft = save_float32(model, tokenizer, 4, where / "draft")
    ours = Server([sys.executable, "-m", "hf_specdec", "serve", target, "--draft", draft], where / "ours.log")
    theirs = Server([sys.executable, "-m", "transformers.cli.transformers", "serve", target, "--continuous-batching"],
                    where / "transformers.log")
    try:
        yield ours.wait(), theirs.wait(), target
    finally:
        ours.stop()
        theirs.stop()


def chat(server: Server, model: str, question: str, stream: bool = False) -> str:
    messages = [{"role": "user", "content": question}]
    out = server.client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=stream)
    if stream:
        return "".join(chunk.choices[0].delta.content or "" for chunk in out if chunk.choices)
    return out.choices[0].message.content


def test_greedy_answers_are_transformers_serve_s_streamed_or_not_and_concurrent(servers):
    ours, theirs, model = servers
    answers = {}
    for server in (ours, theirs):      # one server at a time, its requests concurrent (a batch)
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            batch = list(pool.map(lambda q: chat(server, model, q), QUESTIONS))
        answers[server] = batch, [chat(server, model, q, stream=True) for q in QUESTIONS[:2]]
    assert answers[ours] == answers[theirs]
    assert all(answers[ours][0])
    assert answers[ours][1] == answers[ours][0][:2]
    assert "[hf_specdec.serve] serving LlamaForCausalLM with speculation: draft" in ours.output()
    assert "[hf_specdec.batch_processor] speculation: " in ours.output()   # a step verified drafts


def test_a_bad_request_gets_the_server_s_error_and_the_server_goes_on(servers):
    ours, theirs, model = servers
    errors = []
    for server in (ours, theirs):
        with pytest.raises(openai.APIStatusError) as error:
            server.client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4, extra_body={"not_a_field": 1})
        errors.append((error.value.status_code, error.value.body))
    assert errors[0] == errors[1] and errors[0][0] == 422
    assert chat(ours, model, QUESTIONS[1]) == chat(theirs, model, QUESTIONS[1])


def test_an_over_long_prompt_or_no_messages_gets_a_400_and_the_server_goes_on(servers):
    """What would fail Transformers' generation loop, and every request after it (its worker dies: 500,
    then 503 and an unhealthy /health), is refused with a 400 before it gets there."""
    ours, theirs, model = servers
    too_long = [{"role": "user", "content": "word " * 20000}]      # the cache: 64 blocks of 256 tokens
    for messages, stream in ((too_long, False), (too_long, True), ([], False), (None, False)):
        with pytest.raises(openai.BadRequestError) as error:
            ours.client.chat.completions.create(model=model, messages=messages, max_tokens=4, stream=stream)
        # (Transformers 5.25 checks the prompt against the model's context itself, before our cache check)
        expected = ("paged cache holds", "takes at most") if messages else ("messages must be a non-empty list",)
        assert any(text in str(error.value.body) for text in expected), error.value.body
    assert chat(ours, model, QUESTIONS[1]) == chat(theirs, model, QUESTIONS[1])
    with urllib.request.urlopen(f"http://localhost:{ours.port}/health") as health:
        assert health.status == 200

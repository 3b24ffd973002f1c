"""`transformers serve` (transformers/cli/serving/, the same in 5.23 and 5.24): where `python -m
hf_specdec serve` hooks in. `ModelManager._load_model` loads each model the server serves (its
device, dtype, quantization; GGUF weights named `repo:file.gguf`), `build_server` makes its FastAPI
app, each handler's `_validate_request` checks a body first, and the CLI is the typer app
`transformers.cli.transformers.app`.
"""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def serve_loads(on_load):
    """Within it, each model `transformers serve` loads passes through `on_load(model, load) -> model`,
    where `load(name)` loads another model as the server loads its own."""
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.utils import split_model_id
    original = ModelManager._load_model

    def load_model(self, model_id_and_revision, *args, **kwargs):
        def load(name: str):
            repo, gguf_file = split_model_id(name)
            return original(self, self.process_model_name(repo), gguf_file=gguf_file)
        return on_load(original(self, model_id_and_revision, *args, **kwargs), load)

    ModelManager._load_model = load_model
    try:
        yield
    finally:
        ModelManager._load_model = original


@contextlib.contextmanager
def serve_refusals(check_chat, refused: type[Exception]):
    """Within it, `transformers serve` checks each chat completion's body with `check_chat(body)` after
    its own validation, and answers a `refused` exception (from `check_chat`, or a continuous
    batching manager's `add_request`) with a 400 and its message, as OpenAI answers an invalid
    request, instead of its 500."""
    from fastapi.responses import JSONResponse
    from transformers.cli.serving import server
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    build, validate = server.build_server, ChatCompletionHandler._validate_request

    async def answer(request, error):
        return JSONResponse({"error": {"message": str(error), "type": "invalid_request_error"}}, status_code=400)

    def build_server(*args, **kwargs):
        app = build(*args, **kwargs)
        app.add_exception_handler(refused, answer)
        return app

    def validated(self, body: dict) -> None:
        validate(self, body)
        check_chat(body)

    server.build_server, ChatCompletionHandler._validate_request = build_server, validated
    try:
        yield
    finally:
        server.build_server, ChatCompletionHandler._validate_request = build, validate


def transformers_cli(args: list[str]) -> None:
    """Run `transformers <args>` in this process (it exits the process when done)."""
    from transformers.cli.transformers import app
    app(args)

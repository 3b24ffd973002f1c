"""`transformers serve` (transformers/cli/serving/): where `python -m hf_specdec serve` hooks in.

Each model the server serves is loaded by Transformers, with the server's device, dtype and
quantization (GGUF weights named `repo:file.gguf`), and passed through our `on_load(model, load)`
(`serve_loads`), where `load(name)` loads another model the same way:
- 5.24 loads it in the server's process, in `ModelManager._load_model`: we wrap that method.
- 5.25 loads it in a spawned process of its own (the engine), with a pickled copy of the server's
  `ModelLoader`; a patch made here does not reach it. The one hook is that loader's class:
  `SpeculatingLoader`, which the server builds in place of `ModelLoader` and which carries
  `on_load`, plain data (a module-level function and its keyword arguments), to the engine.
The FastAPI app is built by `build_server`, each handler's `_validate_request` checks a body first,
and the CLI is the typer app `transformers.cli.transformers.app` (the same in both).
"""
from __future__ import annotations

import contextlib
import logging

try:        # 5.25: each model in an engine process of its own, loaded by a ModelLoader
    from transformers.cli.serving.model_manager import ModelLoader
except ImportError:
    ModelLoader = None


if ModelLoader is not None:
    class SpeculatingLoader(ModelLoader):
        """The server's loader (5.25), whose `load_model_and_processor` (run in the engine process)
        passes the model through `on_load(model, load)`. `on_load` is taken from `pending` when the
        server builds the loader, and travels with it (pickled) to the engine."""
        pending = None

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.on_load = SpeculatingLoader.pending

        def load_model_and_processor(self, model_id, on_progress=None):
            from transformers.cli.serving.utils import canonical_model_id
            model, processor = super().load_model_and_processor(model_id, on_progress=on_progress)
            if self.on_load is None:
                return model, processor
            _log_like_the_parent()
            return self.on_load(model, lambda name: self._load_model(canonical_model_id(name))), processor


def _log_like_the_parent() -> None:
    """Our INFO lines in the engine process as in the command's (`python -m hf_specdec`): a spawned
    process starts with logging unset."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")


@contextlib.contextmanager
def serve_loads(on_load):
    """Within it, each model `transformers serve` loads passes through `on_load(model, load) -> model`,
    where `load(name)` loads another model as the server loads its own. On 5.25 `on_load` is pickled
    to the model's process: a module-level function, or a `functools.partial` of one with plain data."""
    from transformers.cli.serving import model_manager
    if ModelLoader is not None:
        SpeculatingLoader.pending, model_manager.ModelLoader = on_load, SpeculatingLoader
        try:
            yield
        finally:
            SpeculatingLoader.pending, model_manager.ModelLoader = None, ModelLoader
        return
    from transformers.cli.serving.utils import split_model_id
    original = model_manager.ModelManager._load_model

    def load_model(self, model_id_and_revision, *args, **kwargs):
        def load(name: str):
            repo, gguf_file = split_model_id(name)
            return original(self, self.process_model_name(repo), gguf_file=gguf_file)
        return on_load(original(self, model_id_and_revision, *args, **kwargs), load)

    model_manager.ModelManager._load_model = load_model
    try:
        yield
    finally:
        model_manager.ModelManager._load_model = original


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

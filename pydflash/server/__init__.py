"""An OpenAI- and Anthropic-compatible HTTP server for a pydflash Engine, with a chat page at `/`.

    pydflash serve --target T.gguf --draft D/ [--port 8080] [--api-key KEY] [--alias NAME]
    pydflash serve --demo                      # a synthetic target/draft pair, nothing to download
    python -m pydflash.server ...              # the same

Modules, one concern each: app (routes, error shapes), openai_api and anthropic_api (the endpoints), schemas
(request validation), chat (conversations into the chat template), parsing (stop sequences, reasoning,
tool calls), worker (the single decode thread and its bounded queue), state (what routes share), cli.
"""
__all__ = ["create_app"]


def __getattr__(name):          # imported on use, so `pydflash run` does not load the web stack
    if name == "create_app":
        from .app import create_app
        return create_app
    raise AttributeError(name)

"""Which chat template renders a request: the checkpoint's, ``--chat-template``'s, or the shipped tool template.

Job: tools are rendered by the chat template (``apply_chat_template(..., tools=...)``).
A template that never mentions ``tools`` cannot render them (SmolLM2's is one), so
a request with tools on such a model gets the ChatML/Hermes tool template that
ships with prefixserve (``chat_templates/chatml_tools.jinja``), unless the operator gave
one with ``--chat-template`` (a file, as vLLM's flag), which then renders every
request.

Pure Python (importlib.resources only).
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path

TOOL_TEMPLATE = "chatml_tools.jinja"


@lru_cache(maxsize=1)
def tool_chat_template() -> str:
    """The shipped ChatML/Hermes tool template's text."""
    return (
        resources.files("prefixserve.replica.tool_calling").joinpath("chat_templates", TOOL_TEMPLATE).read_text("utf-8")
    )


def load_chat_template(path: str) -> str:
    """The text of a ``--chat-template`` file; ValueError naming the path when it cannot be read."""
    try:
        text = Path(path).read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"chat_template {path!r} cannot be read: {exc}") from None
    if not text.strip():
        raise ValueError(f"chat_template {path!r} is empty")
    return text


def renders_tools(template: str | None) -> bool:
    """Whether a chat template can render tools at all (it reads the ``tools`` variable)."""
    return bool(template) and "tools" in template  # type: ignore[operator]


def template_for(model_template: str | None, configured: str | None, has_tools: bool) -> str | None:
    """The template text to render with; None means the checkpoint's own.

    ``configured``: the ``--chat-template`` text, which wins. Otherwise a request with
    tools on a model whose template cannot render them gets the shipped tool template.
    """
    if configured is not None:
        return configured
    if has_tools and not renders_tools(model_template):
        return tool_chat_template()
    return None

"""Image placeholders in conversational rows: TRL's content parts ``{"type": "image"}`` beside
``{"type": "text", "text": ...}``. A conversation without image parts gets one per image before the text of its first
user turn with string content (as TRL's ``prepare_multimodal_messages``); one with image parts must name exactly as
many images as the row has."""

from __future__ import annotations

from typing import Any


def count_image_parts(messages: list[dict[str, Any]]) -> int:
    """How many ``{"type": "image"}`` parts the conversation holds (tool turns excluded, as TRL counts)."""
    return sum(1 for message in messages if message.get("role") != "tool" and isinstance(message.get("content"), list)
               for part in message["content"] if isinstance(part, dict) and part.get("type") == "image")


def _insert_images(messages: list[dict[str, Any]], num_images: int) -> list[dict[str, Any]]:
    """TRL's rule: the first user turn whose content is a string gets ``num_images`` image parts before its text."""
    out, placed = [], False
    for message in messages:
        if not placed and message.get("role") == "user" and isinstance(message.get("content"), str):
            placed = True
            if num_images:
                parts = [{"type": "image"} for _ in range(num_images)]
                message = {**message, "content": [*parts, {"type": "text", "text": message["content"]}]}
        out.append(message)
    return out


def with_image_parts(messages: list[dict[str, Any]], num_images: int, *, where: str) -> list[dict[str, Any]]:
    """The conversation with its image placeholders checked against ``num_images``. One without image parts gets
    them by TRL's rule (before the text of the first user turn with string content); other string contents stay
    strings. Raises ``ValueError`` naming ``where`` when the counts differ."""
    existing = count_image_parts(messages)
    out = messages if existing or not num_images else _insert_images(messages, num_images)
    if count_image_parts(out) != num_images:
        raise ValueError(f"{where}: the conversation has {existing} image placeholder(s) ({{\"type\": \"image\"}} "
                         f"parts) but the row has {num_images} image(s); each image needs exactly one placeholder "
                         "where it is shown (a conversation without image parts gets them before the text of its "
                         "first user turn with string content).")
    return out


def as_content_parts(messages: Any, num_images: int) -> Any:
    """A conversation with every string content as one text part, the row's images placed first as
    ``with_image_parts`` places them (what TRL's ``prepare_multimodal_messages`` makes of it, placeholders not yet
    filled); anything else unchanged."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return messages
    if num_images and not count_image_parts(messages):
        messages = _insert_images(messages, num_images)
    return [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
            for m in messages]


def text_view(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with each content-part list joined to one string (``<image>`` for an image part), so the
    checks of text conversations (roles, empty turns, tool calls) apply to image conversations too."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join("<image>" if isinstance(p, dict) and p.get("type") == "image"
                              else str(p.get("text") or "") if isinstance(p, dict) else str(p) for p in content)
            message = {**message, "content": content}
        out.append(message)
    return out

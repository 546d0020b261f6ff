"""Image placeholders in conversational rows: TRL's content parts ``{"type": "image"}`` beside
``{"type": "text", "text": ...}``. A conversation with string contents gets one image part per image at the start of
its first user turn (as TRL's ``prepare_multimodal_messages``); one with parts must name exactly as many images as
the row has."""

from __future__ import annotations

from typing import Any


def count_image_parts(messages: list[dict[str, Any]]) -> int:
    """How many ``{"type": "image"}`` parts the conversation holds (tool turns excluded, as TRL counts)."""
    return sum(1 for message in messages if message.get("role") != "tool" and isinstance(message.get("content"), list)
               for part in message["content"] if isinstance(part, dict) and part.get("type") == "image")


def _has_parts(messages: list[dict[str, Any]]) -> bool:
    return any(isinstance(message.get("content"), list) for message in messages)


def with_image_parts(messages: list[dict[str, Any]], num_images: int, *, where: str) -> list[dict[str, Any]]:
    """The conversation with its image placeholders checked against ``num_images`` (or inserted: string contents
    only). Raises ``ValueError`` naming ``where`` when the counts differ."""
    if not _has_parts(messages):
        if not num_images:
            return messages
        out, placed = [], False
        for message in messages:
            if message.get("role") == "user" and not placed and isinstance(message.get("content"), str):
                parts = [{"type": "image"} for _ in range(num_images)]
                message = {**message, "content": [*parts, {"type": "text", "text": message["content"]}]}
                placed = True
            out.append(message)
        if not placed:
            raise ValueError(f"{where}: the row has {num_images} image(s) but no user turn to show them in.")
        return out
    placeholders = count_image_parts(messages)
    if placeholders != num_images:
        raise ValueError(f"{where}: the conversation has {placeholders} image placeholder(s) "
                         f"({{\"type\": \"image\"}} parts) but the row has {num_images} image(s); each image needs "
                         "exactly one placeholder where it is shown.")
    return messages

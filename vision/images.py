"""A row's images, in TRL's formats: an ``images`` column (a list per row) or ``image`` (one), each a file path, a
PIL image, or the ``datasets`` image feature's ``{"bytes": ..., "path": ...}`` dict (parquet, ``Dataset.cast_column``).

A relative path is read from the folder of the data file that names it (``base_dir``), so a dataset folder can be
moved as a whole; an image that cannot be opened is refused naming the row, the column and the path."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

IMAGE_COLUMNS = ("images", "image")


def image_column(columns: Any) -> str | None:
    """The data's image column (``images`` before ``image``), None when it has neither."""
    return next((c for c in IMAGE_COLUMNS if c in columns), None)


def row_image_values(row: dict[str, Any]) -> list[Any]:
    """The raw image values of a row (``images`` list or ``image`` single; ``[]`` when it has neither or None)."""
    if row.get("images") is not None:
        values = row["images"]
        return list(values) if isinstance(values, (list, tuple)) else [values]
    if row.get("image") is not None:
        return [row["image"]]
    return []


def row_images(row: dict[str, Any], *, where: str, base_dir: str | Path | None = None) -> list[Any]:
    """The row's images opened as RGB PIL images (``where`` names the row in errors, e.g. ``train row 12``)."""
    column = "images" if row.get("images") is not None else "image"
    return [load_image(value, where=f"{where}, column '{column}'" + (f"[{i}]" if column == "images" else ""),
                       base_dir=base_dir) for i, value in enumerate(row_image_values(row))]


def require_pillow() -> None:
    """Images are read with Pillow, the ``vision`` extra: its absence is said before any row is read."""
    import importlib.util

    if importlib.util.find_spec("PIL") is None:
        raise ImportError("Images (a vision-language model, an 'images'/'image' column) need Pillow: "
                          "pip install 'lightalign[vision]'.")


def load_image(value: Any, *, where: str, base_dir: str | Path | None = None):
    """One image value -> an RGB ``PIL.Image.Image`` (decoded now, so a broken file fails here, not in a forward)."""
    require_pillow()
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        image = value
    else:
        source: Any
        if isinstance(value, dict) and (value.get("bytes") is not None or value.get("path") is not None):
            source = io.BytesIO(value["bytes"]) if value.get("bytes") is not None else _resolve(value["path"], base_dir)
            label = value.get("path") or "<bytes>"
        elif isinstance(value, (str, Path)):
            source, label = _resolve(value, base_dir), str(value)
        else:
            raise ValueError(f"{where}: an image must be a file path, a PIL image or a {{'bytes', 'path'}} dict "
                             f"(the datasets image feature), not {type(value).__name__}.")
        if isinstance(source, Path) and not source.is_file():
            hint = f" (relative paths are read from the data file's folder {base_dir})" if base_dir else ""
            raise ValueError(f"{where}: the image '{label}' does not exist: looked for {source}{hint}.")
        try:
            image = Image.open(source)
            image.load()
        except (UnidentifiedImageError, OSError, SyntaxError) as err:
            raise ValueError(f"{where}: the image '{label}' cannot be opened as an image (a corrupt, truncated or "
                             f"non-image file): {err}") from err
    return image if image.mode == "RGB" else image.convert("RGB")


def _resolve(path: str | Path, base_dir: str | Path | None) -> Path:
    path = Path(path).expanduser()
    if path.is_absolute() or base_dir is None:
        return path
    return Path(base_dir) / path


def stored_images(row: dict[str, Any], *, where: str, base_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """The row's images checked (each opened once) and made storable in a prepared dataset: ``{"bytes", "path"}``
    dicts (the datasets image feature's form) with relative paths made absolute, so a collator reopens them from
    anywhere (``load_image``) without the data file's folder."""
    import io as _io

    from PIL import Image

    column = "images" if row.get("images") is not None else "image"
    out = []
    for i, value in enumerate(row_image_values(row)):
        label = f"{where}, column '{column}'" + (f"[{i}]" if column == "images" else "")
        image = load_image(value, where=label, base_dir=base_dir)
        if isinstance(value, Image.Image):
            buf = _io.BytesIO()
            image.save(buf, format="PNG")
            out.append({"bytes": buf.getvalue(), "path": None})
        elif isinstance(value, dict) and value.get("bytes") is not None:
            out.append({"bytes": value["bytes"], "path": None})
        else:
            path = value["path"] if isinstance(value, dict) else value
            out.append({"bytes": None, "path": str(_resolve(path, base_dir).resolve())})
    return out


def image_base_dir(source: Any) -> Path | None:
    """The folder relative image paths of a data source are read from: a local file's folder, a local folder
    itself; None for a hub dataset or a ``Dataset`` object (paths then relative to the working directory)."""
    if not isinstance(source, (str, Path)):
        return None
    path = Path(source).expanduser()
    if path.is_file():
        return path.resolve().parent
    if path.is_dir():
        return path.resolve()
    return None

"""Image files for image-to-text models: which files a `--image` list names, checked before any model loads.

A path is a PNG or JPEG file, or a folder whose PNG and JPEG files are taken in name order. Each file is opened
and verified with Pillow, so that a missing, unreadable or non-image file is one sentence naming it (a usage
error, exit code 2) rather than a stack trace after a slow model load. The pixels themselves come from the model's
own processor (resize, normalisation), never from code here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from nndf.errors import UsageError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def _check_image(path: Path, flag: str) -> Path:
    from PIL import Image, UnidentifiedImageError

    if not path.exists():
        raise UsageError(f"{flag} {path} does not exist")
    try:
        with Image.open(path) as image:
            kind = image.format
            image.verify()
    except UnidentifiedImageError:
        raise UsageError(f"{flag} {path} is not an image that Pillow can read; give PNG or JPEG files") from None
    except OSError as exc:
        raise UsageError(f"{flag} {path} cannot be read: {exc}") from None
    if kind not in ("PNG", "JPEG"):
        raise UsageError(f"{flag} {path} is a {kind} image; give PNG or JPEG files")
    return path


def image_files(paths: Iterable[str | Path], flag: str = "--image") -> list[Path]:
    """Every image file the paths name (folders expanded in name order), each checked to be a readable PNG or JPEG."""
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
            if not found:
                raise UsageError(f"{flag} {path} is a folder without PNG or JPEG files")
            files.extend(_check_image(p, flag) for p in found)
        else:
            files.append(_check_image(path, flag))
    if not files:
        raise UsageError(f"{flag} needs at least one image file or folder")
    return files


def open_images(files: Iterable[Path]) -> list:
    """The images as RGB Pillow images, as BLIP's processor expects them."""
    from PIL import Image

    images = []
    for path in files:
        with Image.open(path) as image:
            images.append(image.convert("RGB"))
    return images


def caption_inputs(processor, files: list[Path], prompt: str | None = None) -> dict:
    """The processor's tensors for these image files, with the same text prefix for each (None: no prefix)."""
    images = open_images(files)
    if prompt:
        return dict(processor(images=images, text=[prompt] * len(images), return_tensors="pt"))
    return {"pixel_values": processor(images=images, return_tensors="pt")["pixel_values"]}

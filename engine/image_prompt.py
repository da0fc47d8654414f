"""What an image becomes in a family's prompt: the text its processor writes in place of the template's image
placeholder (Gemma 3: 256 soft tokens between its image markers; Idefics3 / SmolVLM: a grid of tiles, each its
row and column marker and its positions, then the whole image; Qwen2.5-VL: a position per 28-pixel cell of the
image at its own size), the pixels its encoder takes (resized with Pillow as the family's own image processor
resizes, rescaled and normalised), Qwen2.5-VL's rotary positions, and a request's images in its prefill
(PromptImages: each encoded once, the rows and positions of each step).
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import torch

from .errors import ModelLoadError
from .images import Image, ImageError, image_ids, image_position, image_runs
from .vision import VisionConfig, token_ids

MAX_TILES = 64  # an Idefics3 image split into more tiles than this is refused (a 4096-pixel side at 512: 64)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One image as the encoder and the prompt take it: rows × cols tiles (0 × 0: the whole image only)."""

    rows: int
    cols: int

    @property
    def tiles(self) -> int:
        return self.rows * self.cols + 1 if self.rows else 1


class ImageFormat:
    """A family's image processor: the placeholder its chat template writes for an image part, the text that
    replaces it, and the pixels. Built from config.json's vision side and preprocessor_config.json."""

    def __init__(self, cfg: VisionConfig, pre: dict, token_text, raw: dict):
        """`token_text(id)`: the vocabulary's string of an id (None where there is none); `raw`: config.json."""
        self.cfg = cfg
        self.family = cfg.family
        self.image_token = _token(token_text, cfg.image_token_id, "image_token_id")
        qwen = cfg.family == "qwen2_5_vl"
        mean, std = (
            pre.get("image_mean", CLIP_MEAN if qwen else [0.5] * 3),
            pre.get("image_std", CLIP_STD if qwen else [0.5] * 3),
        )
        if not (_floats(mean) and _floats(std) and all(s > 0 for s in std)):
            raise ModelLoadError("preprocessor_config.json's image_mean / image_std are not three numbers each")
        self.mean, self.std = np.array(mean, np.float32), np.array(std, np.float32)
        rescale = pre.get("rescale_factor", 1 / 255)
        if isinstance(rescale, bool) or not isinstance(rescale, (int, float)) or not 0 < rescale <= 1:
            raise ModelLoadError(f"preprocessor_config.json's rescale_factor {rescale!r} is not a number in (0, 1]")
        self.rescale = float(rescale)
        resample = pre.get("resample", {"gemma3": 2, "qwen2_5_vl": 3}.get(cfg.family, 1))
        if resample not in (0, 1, 2, 3, 4, 5):
            raise ModelLoadError(f"preprocessor_config.json's resample {resample!r} is not one of Pillow's filters")
        self.resample = int(resample)
        if cfg.family == "gemma3":
            ids = token_ids(raw)
            self.placeholder = _token(token_text, ids.get("boi_token_id", 255999), "boi_token_id")
            self.end = _token(token_text, ids.get("eoi_token_id", 256000), "eoi_token_id")
            self.longest = self.tile = cfg.image_size
            self.split = False
        elif qwen:  # any size, resized to whole 28-pixel cells between a least and a most pixel count
            self.placeholder, self.split, self.tile = self.image_token, False, cfg.patch_size * cfg.scale_factor
            size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
            self.least = _count(pre.get("min_pixels", size.get("shortest_edge", 56 * 56)), "min_pixels")
            self.most = _count(pre.get("max_pixels", size.get("longest_edge", 28 * 28 * 1280)), "max_pixels")
        else:
            self.placeholder = self.image_token
            self.tile = _side(pre.get("max_image_size", {}), cfg.image_size)
            self.longest = _side(pre.get("size", {}), 4 * self.tile)
            self.split = bool(pre.get("do_image_splitting", True))
            if self.tile != cfg.image_size:
                raise ModelLoadError(f"max_image_size {self.tile} is not the encoder's image_size {cfg.image_size}")

    # --- the prompt ---------------------------------------------------------------------------------
    def grid(self, image: Image) -> tuple[int, int]:
        """Qwen2.5-VL: the patch grid (rows, columns) of the image resized as its processor resizes it."""
        h, w = smart_resize(image.height, image.width, self.tile, self.least, self.most)
        return h // self.cfg.patch_size, w // self.cfg.patch_size

    def layout(self, image: Image) -> Layout:
        """The tile grid an image is split into (from its size alone: nothing is decoded)."""
        if not self.split:
            return Layout(0, 0)
        h, w = self._sizes(image.height, image.width)[1]
        if h <= self.tile and w <= self.tile:
            return Layout(0, 0)
        return Layout(math.ceil(h / self.tile), math.ceil(w / self.tile))

    def positions(self, image: Image) -> int:
        """The prompt positions an image's rows take (its markers not counted)."""
        if self.family == "qwen2_5_vl":
            gh, gw = self.grid(image)
            return gh * gw // self.cfg.scale_factor**2
        return self.layout(image).tiles * self.cfg.tokens_per_image

    def sequence(self, image: Image) -> str:
        """The text the family's processor writes in place of the template's placeholder for this image."""
        if self.family == "qwen2_5_vl":  # between the template's own <|vision_start|> and <|vision_end|>
            return self.image_token * self.positions(image)
        n = self.cfg.tokens_per_image
        rows = self.image_token * n
        if self.family == "gemma3":
            return f"\n\n{self.placeholder}{rows}{self.end}\n\n"
        fake = "<fake_token_around_image>"
        whole = f"{fake}<global-img>{rows}{fake}"
        grid = self.layout(image)
        if not grid.rows:
            return whole
        lines = "".join(
            "".join(f"{fake}<row_{r + 1}_col_{c + 1}>{rows}" for c in range(grid.cols)) + "\n" for r in range(grid.rows)
        )
        return f"{lines}\n{whole}"

    def template_message(self, message: dict) -> dict:
        """A message with images as the chat templates of these families take it: content parts, the images
        first, then the text."""
        images = message.get("images") or ()
        if not images:
            return message
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": message.get("content") or ""}]
        return {k: v for k, v in message.items() if k != "images"} | {"content": parts}

    def expand(self, text: str, typed: list[tuple[int, int]], images: list[Image]) -> str:
        """The rendered template with each placeholder it wrote (never one typed inside a message's text: `typed`,
        the messages' own characters) replaced by its image's sequence, in order."""
        out, at, k = [], 0, 0
        while True:
            i = text.find(self.placeholder, at)
            if i < 0:
                break
            if any(a <= i < b for a, b in typed):
                out.append(text[at : i + len(self.placeholder)])
            else:
                if k >= len(images):
                    raise ImageError("the chat template wrote more image places than the conversation has images")
                out.append(text[at:i] + self.sequence(images[k]))
                k += 1
            at = i + len(self.placeholder)
        if k != len(images):
            raise ImageError(
                f"the chat template placed {k} of the conversation's {len(images)} images; "
                "this model's template does not show images"
            )
        return "".join(out) + text[at:]

    def mark(self, ids: list[int], images: list[Image], image_token_id: int) -> list[int]:
        """The ids with each image's positions (the image token, in order) replaced by the image's own ids."""
        out, k, left = list(ids), -1, 0
        own: list[int] = []
        for i, t in enumerate(out):
            if t != image_token_id:
                continue
            if not left:
                k += 1
                if k >= len(images):
                    raise ImageError("the prompt holds more image positions than its images take")
                left = self.positions(images[k])
                own = image_ids(images[k], left)
            out[i] = own[len(own) - left]
            left -= 1
        if left or k != len(images) - 1:
            raise ImageError("the prompt's image positions do not match its images")
        return out

    # --- the pixels ---------------------------------------------------------------------------------
    def pixels(self, image: Image) -> torch.Tensor:
        """[tiles, 3, S, S] float32: the image resized, split where the family splits, rescaled and normalised."""
        picture = image.rgb()
        if self.family == "qwen2_5_vl":
            return self._qwen_patches(picture, image)
        if self.family == "gemma3":
            frames = [picture.resize((self.tile, self.tile), resample=self.resample)]
        else:
            (h1, w1), (h2, w2) = self._sizes(picture.height, picture.width)
            picture = picture.resize((w1, h1), resample=self.resample)
            if not self.split:
                frames = [picture.resize((self.tile, self.tile), resample=self.resample)]
            else:
                picture = picture.resize((w2, h2), resample=self.resample)
                frames = []
                if h2 > self.tile or w2 > self.tile:
                    t = self.tile
                    frames = [
                        picture.crop((c * t, r * t, (c + 1) * t, (r + 1) * t))
                        for r in range((h2 - t) // t + 1)
                        for c in range((w2 - t) // t + 1)
                    ]
                    picture = picture.resize((t, t), resample=self.resample)
                frames.append(picture)
        arrays = [self._normalised(np.asarray(f, dtype=np.uint8)) for f in frames]
        return torch.from_numpy(np.stack(arrays))  # [tiles, 3, S, S]

    def _qwen_patches(self, picture, image: Image) -> tuple[torch.Tensor, tuple[int, int]]:
        """(patches [N, 3·t·p·p] cell by cell (2×2 patches together), the grid (gh, gw)): Qwen2.5-VL's processor's
        layout, the image its frame t times over."""
        gh, gw = self.grid(image)
        p, m, t = self.cfg.patch_size, self.cfg.scale_factor, self.cfg.temporal_patch
        x = self._normalised(np.asarray(picture.resize((gw * p, gh * p), resample=self.resample), dtype=np.uint8))
        x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (cells, m, m, C, p, p)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))  # the frame t times
        return torch.from_numpy(np.ascontiguousarray(x).reshape(gh * gw, 3 * t * p * p)), (gh, gw)

    def rope_positions(self, ids: list[int], images: dict) -> torch.Tensor:
        """[3, len(ids)]: Qwen2.5-VL's rotary position of each prompt position (t, h, w): text counts on by one; an
        image's rows at its start plus their row and column (t the start), after which text goes on at the start
        plus the larger of its rows and columns of cells (transformers' get_rope_index)."""
        out = torch.empty(3, len(ids), dtype=torch.long)
        cells = {key: tuple(g // self.cfg.scale_factor for g in self.grid(im)) for key, im in images.items()}
        p = start = 0
        for i, token in enumerate(ids):
            if token >= 0:
                out[:, i] = p
                p += 1
                continue
            key, j = image_position(token)
            gh, gw = cells[key]
            if j == 0:
                start = p
            r, c = divmod(j, gw)
            out[0, i], out[1, i], out[2, i] = start, start + r, start + c
            if j == gh * gw - 1:
                p = start + max(gh, gw)
        return out

    def _normalised(self, hwc: np.ndarray) -> np.ndarray:
        """[H, W, 3] uint8 -> [3, H, W] float32, as the families' processors compute it."""
        x = (hwc.astype(np.float64) * self.rescale).astype(np.float32)
        x = (x - self.mean) / self.std
        return np.ascontiguousarray(x.transpose(2, 0, 1))

    def _sizes(self, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """Idefics3's two resizes: the longest edge to `longest` (even), then each side up to a whole number of
        tiles: ((h1, w1), (h2, w2))."""
        h, w = height, width
        aspect = w / h
        if w >= h:
            w = self.longest
            h = int(w / aspect)
            h += h % 2
        else:
            h = self.longest
            w = int(h * aspect)
            w += w % 2
        h, w = max(h, 1), max(w, 1)
        if max(h, w) > 4096:  # the processor's upper bound
            if w >= h:
                w, h = 4096, max(int(4096 / aspect), 1)
            else:
                h, w = 4096, max(int(4096 * aspect), 1)
        first, aspect = (h, w), w / h  # the second resize keeps the first one's aspect
        t = self.tile
        if w >= h:
            w = math.ceil(w / t) * t
            h = math.ceil(int(w / aspect) / t) * t
        else:
            h = math.ceil(h / t) * t
            w = math.ceil(int(h * aspect) / t) * t
        if (h // t) * (w // t) + 1 > MAX_TILES + 1:
            raise ImageError(f"the image would be split into {(h // t) * (w // t)} tiles; at most {MAX_TILES} are")
        return first, (h, w)


CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]  # OpenAI CLIP's, Qwen2.5-VL's processor's defaults
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def smart_resize(height: int, width: int, factor: int, least: int, most: int) -> tuple[int, int]:
    """Qwen2.5-VL's size for an image: each side a multiple of `factor`, the pixels between `least` and `most`,
    the aspect kept as near as it can be (its processor's rule, to the pixel)."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"an image of {width}×{height} is too narrow for this model (its sides' ratio is over 200)")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > most:
        beta = math.sqrt(height * width / most)
        h, w = (
            max(factor, math.floor(height / beta / factor) * factor),
            max(factor, math.floor(width / beta / factor) * factor),
        )
    elif h * w < least:
        beta = math.sqrt(least / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def _count(v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 28:
        raise ModelLoadError(f"preprocessor_config.json's {what} is {v!r}: out of range")
    return v


def _token(token_text, token_id, what: str) -> str:
    text = token_text(token_id) if isinstance(token_id, int) and not isinstance(token_id, bool) else None
    if text is None:
        raise ModelLoadError(f"config.json's {what} {token_id!r} is not in the tokenizer's vocabulary")
    return text


def _floats(values) -> bool:
    return isinstance(values, list) and len(values) == 3 and all(isinstance(v, (int, float)) for v in values)


def _side(size, default: int) -> int:
    side = size.get("longest_edge", default) if isinstance(size, dict) else default
    if not isinstance(side, int) or isinstance(side, bool) or not 1 <= side <= 8192:
        raise ModelLoadError(f"preprocessor_config.json's size {size!r} is out of range")
    return side


# --- a request's images in its prefill -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ImageRows:
    """The image positions among one prefill step's: which rows, the encoder's values for them, and the runs of
    them that see each other whole (an image's, in Gemma 3)."""

    rows: torch.Tensor  # [n] indices among the step's T positions
    values: torch.Tensor  # [n, D]
    blocks: tuple[tuple[int, int], ...]
    positions: torch.Tensor | None = None  # [3, T]: the step's rotary t, h, w (mrope), else the plain ones


ENCODED_KEPT = 16  # images whose encoder output a model keeps (a message's most; a few MB each)


class PromptImages:
    """A request's images as its prefill meets their positions: each encoded once, when its first uncached
    position comes (the encoder's time counted apart: a named part of the time to the first token); none
    encoded whose positions all come from the cache."""

    def __init__(self, vision, fmt: ImageFormat, images, prompt: list[int]):
        self.vision, self.fmt = vision, fmt
        self.by_key = {im.key: im for im in images}
        self.whole = fmt.family == "gemma3"  # an image's positions attend to each other both ways
        self.seconds = 0.0  # the encoder's time in this request
        self.encoded = 0  # images this request encoded (not kept from an earlier one)
        self.positions = None  # [3, len(prompt)]: each position's rotary t, h, w, where the family has them
        self.rope_offset = 0  # how far the rotary positions after the prompt run ahead of their indices
        if fmt.family == "qwen2_5_vl":
            self.positions = fmt.rope_positions(prompt, self.by_key)
            self.rope_offset = int(self.positions.max()) + 1 - len(prompt)

    def piece(self, tokens: list[int], done: int, n: int, most: int | None = None) -> int:
        """How many of tokens[done:] the next step takes, given `n` asked: where the positions of an image seeing
        itself whole would be cut, the step ends before the image, or (the image starting the step) takes it all,
        up to `most` (a sliding ring's reach)."""
        end = min(done + n, len(tokens))
        if not self.whole or end >= len(tokens) or tokens[end - 1] >= 0 or tokens[end] >= 0:
            return end - done
        key = image_position(tokens[end])[0]
        if image_position(tokens[end - 1])[0] != key:
            return end - done
        first = end - 1
        while first > done and tokens[first - 1] < 0 and image_position(tokens[first - 1])[0] == key:
            first -= 1
        if first > done:  # the image starts inside the step: the step stops before it
            return first - done
        last = end
        while last < len(tokens) and tokens[last] < 0 and image_position(tokens[last])[0] == key:
            last += 1
        return min(last, done + most) - done if most else last - done

    def rows(self, piece: list[int], first: int) -> ImageRows | None:
        """The image rows of a step's positions (prompt positions first.. ), None where it holds none and its
        rotations are the plain ones."""
        at = [i for i, t in enumerate(piece) if t < 0]
        positions = None if self.positions is None else self.positions[:, first : first + len(piece)]
        if not at:
            empty = torch.empty(0, dtype=torch.long)
            return None if positions is None else ImageRows(empty, torch.empty(0), (), positions)
        values = []
        for i in at:
            key, j = image_position(piece[i])
            values.append(self._encoded(key)[j])
        blocks = tuple((a, b) for a, b, _ in image_runs(piece)) if self.whole else ()
        device = values[0].device
        return ImageRows(torch.tensor(at, device=device), torch.stack(values), blocks, positions)

    def encode(self, piece: list[int]):
        """Encode the images a step's positions need that the model does not keep, a layer at a time: yields
        between layers (the prefill gives the engine's other requests, and a Stop, their turn there)."""
        yield from self._encode(dict.fromkeys(image_position(t)[0] for t in piece if t < 0))

    def _encode(self, keys):
        for key in keys:
            if key in self.vision.kept:
                continue
            image = self.by_key.get(key)
            if image is None:
                raise ImageError("an image position of the prompt has no image beside it")
            t0 = time.perf_counter()
            with torch.inference_mode():
                steps = self.vision.steps(self.fmt.pixels(image))
                while True:
                    try:
                        next(steps)
                    except StopIteration as done:
                        out = done.value  # [tiles, n, D] or [n, D]
                        break
                    self.seconds += time.perf_counter() - t0
                    yield
                    t0 = time.perf_counter()
            self.vision.kept[key] = out.reshape(-1, out.shape[-1])
            self.seconds += time.perf_counter() - t0
            self.encoded += 1
            while len(self.vision.kept) > ENCODED_KEPT:
                self.vision.kept.pop(next(iter(self.vision.kept)))

    def _encoded(self, key: int) -> torch.Tensor:
        """[positions, D]: the image's rows, every tile's in order (encoded now unless the model kept them)."""
        for _ in self._encode([key]):
            pass
        if key not in self.vision.kept:
            raise ImageError("an image position of the prompt has no image beside it")
        return self.vision.kept[key]

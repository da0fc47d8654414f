"""What a person sets (model, precision, sampling, system prompt) and where kvchat keeps its data.
No Qt here: the dialog and the QSettings file are in settings_dialog.py."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from engine.quant import DEFAULT_GROUP_SIZE
from engine.sampling import SamplingParams
from engine.spec import LoadSpec


def data_dir() -> Path:
    """KVCHAT_DATA_DIR when set (tests, portable installs), else the platform's user data directory."""
    env = os.environ.get("KVCHAT_DATA_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("kvchat", appauthor=False))


@dataclasses.dataclass
class Settings:
    model_dir: str = ""  # empty: the bundled demo model
    device: str = "auto"
    dtype: str = "auto"
    capacity: int = 0  # 0: min(model context, 4096)
    weights: str = "none"  # weight precision: none (the dtype) | int8 | int4
    kv: str = "none"  # KV cache precision: none (the dtype) | int8 | int4
    group_size: int = DEFAULT_GROUP_SIZE  # values per quantization scale (0: one per output channel)
    system_prompt: str = ""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 256
    seed: int = -1  # -1: random

    @classmethod
    def load(cls, qs) -> Settings:
        """From a QSettings (or anything with contains/value); a bad stored value keeps the default."""
        s = cls()
        for f in dataclasses.fields(cls):
            if qs.contains(f.name):
                raw = qs.value(f.name)
                try:
                    setattr(s, f.name, type(getattr(s, f.name))(raw))
                except (TypeError, ValueError):
                    pass  # a bad stored value keeps the default
        return s

    def save(self, qs) -> None:
        for f in dataclasses.fields(self):
            qs.setValue(f.name, getattr(self, f.name))
        qs.sync()

    def load_spec(self) -> LoadSpec:
        """What the worker loads: "auto" and 0 mean the engine's own defaults."""
        return LoadSpec(
            path=self.model_dir or None,
            device=None if self.device == "auto" else self.device,
            dtype=None if self.dtype == "auto" else self.dtype,
            capacity=self.capacity or None,
            weights=self.weights,
            kv=self.kv,
            group_size=self.group_size,
        )

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=None if self.seed < 0 else self.seed,
        )

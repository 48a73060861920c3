"""The test family's configs (mirroring testfamily.walk's variants) and a builder of its nodes.

`CONFIGS` duplicates the `.walk` variants so that tests and the reference can build the nodes
without the compiler (the runtime must not import it); a test checks that both agree.
`build_family` makes the NodeSpecs a plan would give; `Family` also wraps node instances a
runtime built itself, so the reference can run on exactly the weights the runtime serves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mstar_models.testfamily.codec import TinyCodec
from mstar_models.testfamily.flow import TinyFlow
from mstar_models.testfamily.lm import TinyLM
from mstar_models.testfamily.prompt import TinyPrompt
from mstar_runtime.ops import node

_REAL: dict[str, Any] = {
    "layers": 2,
    "hidden": 64,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 16,
    "intermediate": 128,
    "vocab": 272,
    "tie_embeddings": False,
    "rope_theta": 10000.0,
    "rms_eps": 1.0e-6,
    "bos": 1,
    "eos": 2,
    "byte_offset": 16,
    "max_context": 512,
    "max_new_tokens": 128,
    "codebook": 64,
    "codec_dim": 32,
    "codec_kernel": 3,
    "hop": 16,
    "latent_len": 4,
    "latent_dim": 8,
    "max_flow_steps": 16,
    "win": 8,
    "stride": 4,
    "block": 5,
    "chunk": 4,
    "left": 3,
    "max_batch": 8,
    "dtype": "f32",
}
CONFIGS: dict[str, dict[str, Any]] = {
    "real": _REAL,
    "tiny": {
        **_REAL,
        "hidden": 32,
        "head_dim": 8,
        "intermediate": 64,
        "tie_embeddings": True,
        "max_context": 96,
        "max_new_tokens": 32,
        "codec_dim": 16,
        "hop": 8,
        "max_flow_steps": 8,
    },
}

LLAMA_ARGS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "tie_embeddings")

# node name -> (class, engine, settings) as testfamily.walk declares them
NODES: dict[str, tuple[type, str, tuple[str, ...]]] = {
    "prompt": (TinyPrompt, "stateless", ()),
    "lm": (TinyLM, "kv", ("max_batch",)),
    "codec": (TinyCodec, "stateless", ("max_batch",)),
    "flow": (TinyFlow, "stateless", ()),
}

# The chunk policy of each generate walk's stream and the codec phase that drains it.
STREAMS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "generate": ("sliding", ("win", "stride"), "decode_window"),
    "generate_fixed": ("fixed", ("block",), "decode_block"),
    "generate_left": ("left_context", ("chunk", "left"), "decode_frames"),
}


def stream_policy(walk: str, config: Mapping[str, Any]) -> tuple[str, dict[str, int]]:
    """(kind, params) of a generate walk's stream, with the runtime's parameter names."""
    kind, names, _ = STREAMS[walk]
    keys = {"sliding": ("window", "stride"), "fixed": ("size",), "left_context": ("chunk", "left")}[kind]
    return kind, {k: int(config[n]) for k, n in zip(keys, names, strict=True)}


@dataclass
class Family:
    """The four nodes of one model instance; the reference runs on these modules' weights."""

    prompt: TinyPrompt
    lm: TinyLM
    codec: TinyCodec
    flow: TinyFlow

    @property
    def config(self) -> Mapping[str, Any]:
        return self.lm.spec.config

    @classmethod
    def from_nodes(cls, nodes: Mapping[str, Any]) -> Family:
        """Wrap node instances by their .walk names (e.g. a runtime worker's)."""
        return cls(**{name: nodes[name] for name in NODES})


def node_spec(
    name: str,
    config: Mapping[str, Any],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> node.NodeSpec:
    _, engine, setting_names = NODES[name]
    arch_args = {k: config[k] for k in LLAMA_ARGS} if name == "lm" else {}
    settings: dict[str, Any] = {k: config[k] for k in setting_names}
    if seed:
        settings["seed"] = seed
    return node.NodeSpec(
        name=name,
        engine=engine,
        config=dict(config),
        arch_args=arch_args,
        settings=settings,
        dtype=dtype,
        device=torch.device(device),
    )


def build_family(
    variant: str = "tiny",
    overrides: Mapping[str, Any] | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> Family:
    """Build the nodes of a variant (float32), optionally with config values overridden."""
    config = {**CONFIGS[variant], **(overrides or {})}
    nodes = {name: cls(node_spec(name, config, device, seed=seed)) for name, (cls, _, _) in NODES.items()}
    for instance in nodes.values():
        instance.eval()
    return Family.from_nodes(nodes)

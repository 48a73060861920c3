"""What BAGEL's chat -> t2i transition changes against the official think-then-draw flow (tiny, CPU).

M*'s transition keeps the reply's decode KV in `gen` (<|im_start|> + reply, no <|im_end|>)
and t2i appends the request's prompt again, with cfg_text = gen before it and cfg_img = gen;
the official flow (the `think` walk) re-encodes the reply's *text* as a segment in gen only,
with cfg_text = before the prompt and cfg_img = the prompt. Both run here on the same tiny
random weights through the dense reference (models/mstar_models/bagel/reference.py), 8 Euler
steps of the default CFG, for 8 prompts and 12-token replies; printed: the final latents'
difference relative to how far the steps moved them. docs/models/bagel.md records the figure.

    .venv/bin/python tools/bagel_transition_effect.py
"""

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from mstar_models.bagel.flow import combine, shifted_times
from mstar_models.bagel.reference import ReferenceConfig, ReferenceContext
from mstar_runtime.api import MStar

ROOT = Path(__file__).resolve().parents[1]
out = Path(tempfile.mkdtemp()) / "bagel.plan"
subprocess.run([sys.executable, "-m", "mstarc.cli", "compile", str(ROOT / "models/bagel/bagel.walk"), "--variant",
                "tiny", "--placement", str(ROOT / "placements/cpu.yaml"), "-o", str(out)], check=True,
               capture_output=True)
res = []
with MStar.load(out, weights="dummy") as m:
    w = m.conductor.workers[0].engines
    llm, tok = w["llm"].node, w["tok"].node
    c = llm.spec.config
    cfg = ReferenceConfig(layers=c["layers"], heads=c["heads"], kv_heads=c["kv_heads"], head_dim=c["head_dim"],
                          max_latent_size=c["max_latent_size"], bos_id=c["bos_id"], eos_id=c["eos_id"],
                          vision_start_id=c["vision_start_id"], vision_end_id=c["vision_end_id"])
    weights = {k: v.detach().float().clone() for k, v in llm.state_dict().items()}
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        prompt = tok.run("encode", [{"text": f"draw a fox number {seed}"}])[0]["ids"].long()
        reply = torch.randint(0, 290, (12,), generator=g)  # a reply's ids (random weights: any ids)
        base = ReferenceContext(weights, cfg)
        base.text(prompt)
        # (a) M*'s transition: the decode KV (<|im_start|> + reply, no <|im_end|>) stays, t2i appends the prompt again
        a = base.copy()
        for t in [c["bos_id"], *reply.tolist()]:
            a.step(t)
        a_text = a.copy()  # cfg_text: gen before t2i's prompt
        a.text(prompt)
        # (b) the official think flow: the reply's text re-encoded as a segment
        b = base.copy()
        b_text = ReferenceContext(weights, cfg)  # the official cfg_text: before the prompt (no system prompt here)
        b_img = base.copy()  # the official cfg_img: the prompt, no reasoning
        again = tok.run("reencode", [{"reasoning": reply.to(torch.int32)}])[0]["ids"].long()
        b.text(again)
        x0 = torch.randn(4 * 4, int(c["patch_dim"]), generator=g)
        ts = shifted_times(9, 3.0)
        lat = {}
        for name, gen, txt, img in (("a", a, a_text, a.copy()), ("b", b, b_text, b_img)):
            x = x0.clone()
            for i in range(8):
                t, dt = float(ts[i]), float(ts[i] - ts[i + 1])
                v = gen.velocity(x, t, 64, 64)
                if 0.4 < t <= 1.0:
                    v = combine(v, txt.velocity(x, t, 64, 64), img.velocity(x, t, 64, 64), 4.0, 1.5, "global", 0.0)
                x = x - v * dt
            lat[name] = x
        d = ((lat["a"] - lat["b"]).norm() / (lat["b"] - x0).norm()).item()
        res.append(d)
print("relative difference of the final latent (|a-b| / |b-x0|) per seed:", [round(r, 3) for r in res])
print("mean", sum(res) / len(res))

"""Run prime-rl's own TokenExporter (from a git commit of PrimeIntellect-ai/prime-rl) on tiny inputs.

Usage: python make_fixture.py PRIME_RL_CHECKOUT COMMIT OUT_DIR LAYOUT
Only token_export.py runs from the source; its two imports from prime_rl are given: the DefaultLossConfig
defaults (dppo_mask_low = dppo_mask_high = 0.2, as configs/trainer.py of the commit has them) and
compute_importance_ratio_and_mismatch_kl, extracted verbatim from the commit's trainer/rl/loss.py.
"""
import ast
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch

REPO, commit, out, layout = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]


def show(path):
    return subprocess.run(["git", "-C", REPO, "show", f"{commit}:{path}"], capture_output=True, text=True,
                          check=True).stdout


loss_src = show("src/prime_rl/trainer/rl/loss.py")
fn = next(n for n in ast.parse(loss_src).body if isinstance(n, ast.FunctionDef)
          and n.name == "compute_importance_ratio_and_mismatch_kl")
loss_mod = types.ModuleType("prime_rl.trainer.rl.loss")
loss_mod.__dict__.update(torch=torch, Tensor=torch.Tensor)
exec(compile(ast.Module([fn], []), "loss.py", "exec"), loss_mod.__dict__)


@dataclass
class DefaultLossConfig:
    dppo_mask_low: float = 0.2
    dppo_mask_high: float = 0.2


cfg_mod = types.ModuleType("prime_rl.configs.trainer")
cfg_mod.DefaultLossConfig, cfg_mod.TrainerConfig = DefaultLossConfig, object
for name in ("prime_rl", "prime_rl.configs", "prime_rl.trainer", "prime_rl.trainer.rl"):
    sys.modules[name] = types.ModuleType(name)
sys.modules["prime_rl.configs.trainer"], sys.modules["prime_rl.trainer.rl.loss"] = cfg_mod, loss_mod
export_mod = types.ModuleType("prime_rl.trainer.rl.token_export")
exec(compile(show("src/prime_rl/trainer/rl/token_export.py"), "token_export.py", "exec"), export_mod.__dict__)

# Two steps, two ranks, each micro-batch one packed row (1, L) of two samples: prompt tokens (loss_mask False),
# completion tokens (True), and trailing padding (env name "" and no loss) that the exporter trims.
g = torch.Generator().manual_seed(0)
for rank in (0, 1):
    exporter = export_mod.TokenExporter(out, rank)
    for step in (0, 1):
        for micro_step in (0, 1):
            lengths, ids, pos, mask, adv, envs = [], [], [], [], [], []
            for s in range(2):
                p, c = 3, int(torch.randint(2, 6, (1,), generator=g))
                pad = 2 if s == 1 else 0
                a = float(torch.randn(1, generator=g))
                ids += torch.randint(5, 100, (p + c,), generator=g).tolist() + [0] * pad
                pos += list(range(p + c)) + [0] * pad
                mask += [False] * p + [True] * c + [False] * pad
                adv += [0.0] * p + [a] * c + [0.0] * pad
                envs += ["math"] * (p + c) + [""] * pad
                lengths.append(p + c + pad)
            L = len(ids)
            inf = -torch.rand(1, L, generator=g) * 2
            trainer = inf + 0.3 * torch.randn(1, L, generator=g)
            mb = {"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([pos]),
                  "loss_mask": torch.tensor([mask]), "advantages": torch.tensor([adv]),
                  "inference_logprobs": inf, "env_names": envs}
            if layout == "training-mode":
                mb["training_mode"] = "rl"
                mb["rewards"] = torch.tensor([[max(a, 0.0) for a in adv]])
            out_model = {"logprobs": trainer.clamp(max=0), "entropy": torch.rand(1, L, generator=g) * 3}
            exporter.export(step, micro_step, mb, out_model, lengths, DefaultLossConfig())
        if hasattr(exporter, "mark_stable"):
            exporter.mark_stable()
    exporter.close()
print("wrote", sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()))

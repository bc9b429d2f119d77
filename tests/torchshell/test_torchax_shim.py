"""torchax imports under a torch that lacks an overload torchax names (torch 2.13 on a TPU VM).

torch 2.13 dropped the named-dimension overloads (``aten.prod.dim_Dimname``, ...) that
torchax 0.0.13 names in its tables at import. The test removes one overload from this torch
in a fresh process, shows that plain ``import torchax`` then fails as it does there, and that
after ``torchshell.trace`` is imported it loads, reports the overload and traces a module.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import json, sys
import torch

packet_cls = torch._ops.OpOverloadPacket
real = packet_cls.__getattr__

# the running torch as torch 2.13 is: no prod.dim_Dimname (named in torchax/amp.py, imported
# with torchax) nor all.dimname (torchax/decompositions.py, imported when tracing starts)
GONE = {("aten::prod", "dim_Dimname"), ("aten::all", "dimname")}

def without(packet, key):
    if (packet._qualified_op_name, key) in GONE:
        raise AttributeError(
            f"The underlying op of '{packet}' has no overload name '{key}'")
    return real(packet, key)

packet_cls.__getattr__ = without
torch.ops.aten.prod.__dict__.pop("dim_Dimname", None)
torch.ops.aten.all.__dict__.pop("dimname", None)

out = {}
try:
    import torchax  # noqa: F401
    out["plain"] = "imported"
except AttributeError as e:
    out["plain"] = str(e)
for name in [m for m in sys.modules if m == "torchax" or m.startswith("torchax.")]:
    del sys.modules[name]

import torchshell.trace  # installs coreshell's loading of torchax
from torchshell.trace import _torchax
import torchax

out["missing_at_import"] = _torchax.missing()
try:
    torch.ops.aten.prod.dim_Dimname
    out["after"] = "tolerated outside torchax's import"
except AttributeError:
    out["after"] = "raises"

from torchshell.torch_model import torch_model_fns
import jax, jax.numpy as jnp
model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU())
x = torch.randn(4, 3)
expected = model(x).detach().numpy()
fns = torch_model_fns(model)
batch = {"x": jnp.asarray(x.numpy())}
params, state = fns.init(jax.random.key(0), batch)
got = fns.apply(params, state, batch, jax.random.key(1), False)[0]
out["traced_max_diff"] = float(abs(jnp.asarray(got) - expected).max())
out["missing"] = _torchax.missing()
print(json.dumps(out))
"""


def test_torchax_loads_when_torch_lacks_an_overload_it_names():
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "no overload name 'dim_Dimname'" in out["plain"]  # torchax alone fails there
    # (under torch 2.13 itself more are missing: aten::index_copy.dimname, ...)
    assert "aten::prod.dim_Dimname" in out["missing_at_import"]
    assert "aten::all.dimname" not in out["missing_at_import"]
    assert "aten::all.dimname" in out["missing"]  # named by a module torchax imports later
    assert out["after"] == "raises"  # the tolerance ends with torchax's import
    assert out["traced_max_diff"] < 1e-6

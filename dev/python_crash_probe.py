# The smallest call into the engine from Python (issue 54's segfault): plan, then one CPU epoch on tensors.
import faulthandler, sys
faulthandler.enable()
import torch
from torch import nn
import triaccel
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 3))
x = torch.randint(0, 255, (64, 1, 8, 8), dtype=torch.uint8)
y = torch.randint(0, 3, (64,))
print("plan:", sorted(triaccel.plan(model, train=(x, y), test=(x, y), optimizer="sgd", device="cpu").keys()), flush=True)
s = triaccel.train(model, train=(x, y), test=(x, y), epochs=1, batch_size=16, device=sys.argv[1] if len(sys.argv) > 1 else "cpu",
                   out="/tmp/probe_run", progress="off")
print("train:", round(s["test_acc"], 4), flush=True)

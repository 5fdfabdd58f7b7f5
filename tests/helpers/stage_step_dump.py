"""Run a stage script's own main() in this process, then save what this rank's model holds: every
parameter and its gradient from the last step (after the script clipped it).

    python tests/helpers/stage_step_dump.py solutions/train_gpt2_std.py OUT_DIR ARGS...
    torchrun --nproc-per-node=2 tests/helpers/stage_step_dump.py solutions/train_gpt2_ddp.py \
        OUT_DIR ARGS...

writes OUT_DIR/rank<R>.safetensors with "param.<name>" and "grad.<name>" for each parameter.
Nothing of the training is re-done here: the script's main() builds, wraps, feeds, reduces and
steps the model as it always does. The one addition is a subclass of its GPT that remembers the
instance main() builds, so that its tensors can be read after main() returns.
"""
import importlib.util
import os
import sys
from pathlib import Path

from safetensors.torch import save_file

script, out, args = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
spec = importlib.util.spec_from_file_location(script.stem, script)
stage = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stage)

built = []


class RememberedGPT(stage.GPT):
    def __init__(self, config):
        super().__init__(config)  # the same initialisation, the same random numbers drawn
        built.append(self)


stage.GPT = RememberedGPT
assert stage.main(args) == 0
(model,) = built
tensors = {}
for name, parameter in model.named_parameters():
    tensors[f"param.{name}"] = parameter.detach().cpu().contiguous()
    tensors[f"grad.{name}"] = parameter.grad.detach().cpu().contiguous()
out.mkdir(parents=True, exist_ok=True)
save_file(tensors, out / f"rank{os.environ.get('RANK', '0')}.safetensors")

"""The model library stands alone: importing it pulls in no Lightning, W&B, OmegaConf or timm."""

import subprocess
import sys


def test_model_library_imports_no_training_stack():
    code = (
        "import sys, mmformer.nn, mmformer.models, mmformer.tokenizers, mmformer.tokenizers.audio,"
        " mmformer.models.pretrained, mmformer.nn.lora, mmformer.models.diffusion, mmformer.tokenizers.diffusion;"
        "print([m for m in ('lightning', 'pytorch_lightning', 'wandb', 'omegaconf', 'timm') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

"""mmformer: a multimodal transformer training platform.

The model library (``mmformer.nn``, ``mmformer.tokenizers``, ``mmformer.models``) depends only on
torch (and torchaudio / safetensors); the training platform (``data``, ``tasks``, ``training``,
``config``, ``build``, ``cli``) adds Lightning, OmegaConf and W&B.
"""

__version__ = "0.1.0"

"""trl's GRPOConfig and GRPOTrainer on this engine: a trl 1.16 script runs here with one import changed
(docs/trl.md). trl itself is not imported."""

from grpo.trl_api.batch import Batch, translate
from grpo.trl_api.config import GRPOConfig
from grpo.trl_api.trainer import GRPOTrainer

__all__ = ["Batch", "GRPOConfig", "GRPOTrainer", "translate"]
